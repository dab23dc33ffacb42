import errno
import http.server
import os
import threading

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from s3fs.errors import translate_boto_error

from generation_core.store.folder import StorageFolder
from generation_core.store.storage_errors import is_transient
from generation_core.store.trajectory_record import TrajectoryRecord, records_from_parquet, records_to_parquet

pytestmark = pytest.mark.timeout(60)


def test_put_atomic_leaves_no_temporary_files(tmp_path):
    folder = StorageFolder(str(tmp_path / "run"))
    folder.put_atomic("shards/shard-00000/a.bin", b"one")
    folder.put_atomic("shards/shard-00000/a.bin", b"two")
    assert folder.read_bytes("shards/shard-00000/a.bin") == b"two"
    assert os.listdir(tmp_path / "run" / "shards" / "shard-00000") == ["a.bin"]
    assert folder.list("shards") == ["shard-00000"]
    assert folder.list("missing") == []


def test_streaming_writer_commits_only_on_success(tmp_path):
    folder = StorageFolder(str(tmp_path))
    try:
        with folder.open_write("big.bin") as handle:
            handle.write(b"partial")
            raise RuntimeError("crash mid-write")
    except RuntimeError:
        pass
    assert not folder.exists("big.bin")
    assert os.listdir(tmp_path) == []
    with folder.open_write("big.bin") as handle:
        handle.write(b"whole")
    assert folder.read_bytes("big.bin") == b"whole"


def test_records_round_trip_through_parquet():
    records = [
        TrajectoryRecord(
            3,
            1,
            [1, 2, 3],
            [4, 5],
            [1, 0],
            [-0.5, 0.0],
            1.5,
            2,
            {"data_source": "x", "index": 3},
            {"turn_scores": []},
            {"generate_sequences": 0.1},
        ),
        TrajectoryRecord(4, 0, [7], [], [], None, None, 2, {}, {}, {}),
    ]
    back = records_from_parquet(records_to_parquet(records))
    assert [r.__dict__ for r in back] == [r.__dict__ for r in records]


# --- all-or-nothing writes on local disk (S3 and every call site: test_atomic_writes) ----------


@pytest.mark.timeout(30)
def test_a_streamed_write_whose_finishing_fails_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    folder = StorageFolder(str(tmp_path))
    folder.put_atomic("big.bin", b"previous")

    def full_disk(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        with folder.open_write("big.bin") as handle:
            handle.write(b"x" * 1000)
    assert folder.read_bytes("big.bin") == b"previous"
    assert os.listdir(tmp_path) == ["big.bin"], "no temporary file left behind"


# --- which storage errors are retried (issue 17, item 4) ------------------------------------------


def _client_error(code: str, status: int, message: str = "", operation: str = "PutObject") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": message or code}, "ResponseMetadata": {"HTTPStatusCode": status}}, operation
    )


TRANSIENT_ANSWERS = [
    ("SlowDown", 503, "Please reduce your request rate."),
    ("ServiceUnavailable", 503, "Service is unable to handle request."),
    ("InternalError", 500, "We encountered an internal error. Please try again."),
    ("Throttling", 400, "Rate exceeded"),
    ("ThrottlingException", 400, "Rate exceeded"),
    (
        "RequestTimeout",
        400,
        "Your socket connection to the server was not read from or written to within the timeout period.",
    ),
    ("BadGateway", 502, "Bad Gateway"),
    ("GatewayTimeout", 504, "Gateway Timeout"),
    ("TooManyRequests", 429, "Too Many Requests"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("code, status, message", TRANSIENT_ANSWERS, ids=[f"{c}-{s}" for c, s, _ in TRANSIENT_ANSWERS])
def test_s3_throttling_and_5xx_are_transient_as_botocore_and_s3fs_raise_them(code, status, message):
    error = _client_error(code, status, message)
    assert is_transient(error), "botocore's ClientError"
    assert is_transient(translate_boto_error(error)), "the OSError s3fs raises, the ClientError in its __cause__"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "error",
    [
        EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),
        ConnectTimeoutError(endpoint_url="http://127.0.0.1:9"),
        ReadTimeoutError(endpoint_url="http://127.0.0.1:9"),
        ConnectionClosedError(endpoint_url="http://127.0.0.1:9"),
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        TimeoutError("timed out"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_dropped_and_timed_out_connections_are_transient(error):
    assert is_transient(error)


PERMANENT = [
    # A message that names a path with 500 or InternalError in it says nothing about the error.
    OSError(errno.EIO, "cannot write s3://bucket/run/shards/shard-00500/batch-00000-1a2b3c4d.parquet"),
    OSError(errno.EINVAL, "s3://bucket/runs/InternalError-503/shards/shard-00502/checkpoint.json: invalid"),
    translate_boto_error(
        _client_error("InvalidArgument", 400, "Invalid argument: s3://bucket/run/shards/shard-00500/checkpoint.json")
    ),
    translate_boto_error(
        _client_error("AccessDenied", 403, "Access Denied for shards/shard-00500 (InternalError-503)")
    ),
    translate_boto_error(_client_error("NoSuchKey", 404, "shards/shard-00500/checkpoint.json")),
    translate_boto_error(
        _client_error(
            "PreconditionFailed", 412, "At least one of the pre-conditions you specified did not hold: shard-00500"
        )
    ),
    KeyError("shard-00500"),
    ValueError("500 InternalError SlowDown"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("error", PERMANENT, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_an_error_that_merely_mentions_500_or_internalerror_is_not_transient(error):
    assert not is_transient(error)


class _ScriptedS3(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that answers every PUT with the error its test scripted, as S3 words it."""

    protocol_version = "HTTP/1.1"  # answers botocore's `Expect: 100-continue` before the body
    answer: tuple[int, str, str] = (503, "SlowDown", "Please reduce your request rate.")
    requests: list[str] = []

    def do_PUT(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).requests.append(self.path)
        status, code, message = type(self).answer
        body = f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message><Resource>{self.path}</Resource><RequestId>1</RequestId></Error>'.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def scripted_s3():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ScriptedS3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "status, code, message, retried",
    [
        (503, "SlowDown", "Please reduce your request rate.", True),
        (500, "InternalError", "We encountered an internal error. Please try again.", True),
        (400, "InvalidArgument", "Invalid argument for /genrun-test/run/shards/shard-00500/checkpoint.json", False),
        (403, "AccessDenied", "Access Denied to /genrun-test/run/shards/shard-00500/checkpoint.json", False),
    ],
    ids=["503-SlowDown", "500-InternalError", "400-in-a-shard-00500-path", "403-in-a-shard-00500-path"],
)
def test_a_real_s3_error_answer_is_retried_only_when_transient(scripted_s3, status, code, message, retried):
    """The whole path: an HTTP answer, botocore's parsing, s3fs's translation, StorageFolder's retry
    (botocore's and s3fs's own retries off, so every request counted is one of ours)."""
    options = {
        "endpoint_url": scripted_s3,
        "key": "k",
        "secret": "s",
        "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}},
        "client_kwargs": {"region_name": "us-east-1"},
    }
    folder = StorageFolder("s3://genrun-test/run", options)
    folder.fs.retries = 1  # s3fs's own retry loop (an attribute, not an option): one attempt
    folder.retry_delays = (0.01, 0.01)
    _ScriptedS3.answer, _ScriptedS3.requests = (status, code, message), []
    with pytest.raises(OSError):
        folder.put_atomic("shards/shard-00500/checkpoint.json", b"{}")
    assert len(_ScriptedS3.requests) == (3 if retried else 1), _ScriptedS3.requests
