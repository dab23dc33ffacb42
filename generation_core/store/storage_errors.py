"""Which storage errors are worth a retry: throttling, 5xx, dropped or timed-out connections
(transient), and which are a conditional write refused (a conflict). Recognised by the
exception's type and, for S3, by botocore's error code and HTTP status in the error s3fs raises
(its `__cause__`), never by words in a message, which may hold a path such as `shard-00500`."""

from __future__ import annotations

import http.client

RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0)
# Missing objects, refused permissions, names taken: answers, not hiccups.
_PERMANENT_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
# The codes botocore's standard retry mode treats as throttling or transient
# (botocore.retries.standard), and S3's own 500 and 503 codes.
_THROTTLING_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "TransactionInProgressException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "RequestThrottled",
        "SlowDown",
        "EC2ThrottledException",
    }
)
_TRANSIENT_CODES = frozenset(
    {"RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete", "InternalError", "ServiceUnavailable"}
)
_TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
# A conditional write refused: the object is not (or no longer) the version it was based on.
_CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
_CONFLICT_STATUS = frozenset({409, 412})


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Errors of the connection, not of the request: the request may be sent again."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError, http.client.IncompleteRead]
    try:
        from botocore import exceptions as botocore_errors

        # EndpointConnectionError, ConnectTimeoutError, ConnectionClosedError, ReadTimeoutError...
        errors += [
            botocore_errors.ConnectionError,
            botocore_errors.HTTPClientError,
            botocore_errors.IncompleteReadError,
        ]
    except ImportError:
        pass
    try:
        import aiohttp

        errors += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    except ImportError:
        pass
    return tuple(errors)


_TRANSPORT_ERRORS = _transport_errors()


def _causes(exc: BaseException):
    """`exc` and the errors it was raised from (s3fs raises an OSError from botocore's error)."""
    error: BaseException | None = exc
    for _ in range(16):
        if error is None:
            return
        yield error
        error = error.__cause__


def service_answer(exc: BaseException) -> tuple[str | None, int | None] | None:
    """(error code, HTTP status) of the S3 answer behind `exc` (botocore's ClientError), or None
    when no service answered."""
    for error in _causes(exc):
        response = getattr(error, "response", None)
        if isinstance(response, dict) and ("Error" in response or "ResponseMetadata" in response):
            return (response.get("Error") or {}).get("Code"), (response.get("ResponseMetadata") or {}).get(
                "HTTPStatusCode"
            )
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether sending the same request again may succeed: throttling, a 5xx, a dropped or timed
    out connection. Decided by types and by S3's code and status, never by the message."""
    if isinstance(exc, _PERMANENT_ERRORS):
        return False
    answer = service_answer(exc)
    if answer is not None:
        code, status = answer
        return code in _THROTTLING_CODES or code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS
    return any(isinstance(error, _TRANSPORT_ERRORS) for error in _causes(exc))


def is_conflict(exc: BaseException) -> bool:
    answer = service_answer(exc)
    return answer is not None and (answer[0] in _CONFLICT_CODES or answer[1] in _CONFLICT_STATUS)
