"""`genrun status DIR` and `genrun merge DIR` take storage options the way the main command
does (`storage.options.KEY=VALUE`, credentials moved to the environment), so a run folder on an
S3 endpoint given only on the command line can be inspected and merged."""

import pytest

from flows.cli import main, storage_options_from
from generation_core.store.commit_log import ShardCheckpoint
from generation_core.store.folder import StorageFolder

pytestmark = pytest.mark.timeout(180)


def test_storage_options_are_read_nested_and_anything_else_is_refused():
    assert storage_options_from(
        ["storage.options.endpoint_url=http://127.0.0.1:9", "+storage.options.client_kwargs.region_name=eu-west-1"]
    ) == {
        "endpoint_url": "http://127.0.0.1:9",
        "client_kwargs": {"region_name": "eu-west-1"},
    }
    with pytest.raises(Exception, match="only storage.options.KEY=VALUE may follow"):
        storage_options_from(["generation.num_shards=2"])


def test_status_and_merge_reach_s3_through_command_line_options(s3_server, monkeypatch, capsys):
    endpoint = s3_server["AWS_ENDPOINT_URL"]
    options = {
        "endpoint_url": endpoint,
        "key": s3_server["AWS_ACCESS_KEY_ID"],
        "secret": s3_server["AWS_SECRET_ACCESS_KEY"],
    }
    url = "s3://genrun-test/runs/status-options"
    folder = StorageFolder(url, options)
    folder.put_json(
        "run.json",
        {
            "fingerprint": "f" * 64,
            "rollout_n": 1,
            "pad_token_id": 0,
            "shards": [{"name": "shard-00000", "range": [0, 3]}],
            "config": {"actor_rollout_ref": {"rollout": {"prompt_length": 4, "response_length": 4}}, "generation": {}},
        },
    )
    # An interrupted shard: one sample failed, no part committed yet.
    ShardCheckpoint().commit_part(folder, "shard-00000", None, [], failed=["0:0"])
    # Nothing in the environment says where the bucket is: only the command line does.
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    arguments = [
        f"storage.options.endpoint_url={endpoint}",
        f"storage.options.key={options['key']}",
        f"storage.options.secret={options['secret']}",
    ]
    assert main(["status", url, *arguments]) == 0
    out = capsys.readouterr().out
    assert "shard-00000  partial  0/3  1 failed sample(s)" in out and "trajectories 0/3; failed samples 1" in out
    assert options["secret"] not in out
    # merge reads the same folder (nothing committed in parts: refused in one line, exit 2).
    assert main(["merge", url, *arguments]) == 2
    assert "nothing to merge" in capsys.readouterr().err
