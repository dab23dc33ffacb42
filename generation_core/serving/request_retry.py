"""Engine requests that survive transient failures: retries with backoff and a timeout.

Agent loops talk to the engine through one call, `await client.generate(request_id, ...)`.
`RetryingClient` wraps the routing client (or any object with that method) and retries a
request that failed for a reason that may pass, with exponential backoff: the replica actor
died or restarts, the call timed out, a connection dropped or a server answered 5xx/429, the
engine failed internally (a batch step, a CUDA error). Anything else fails the sample at once
with its traceback: an invalid request (ValueError/TypeError: a prompt beyond the context, bad
sampling parameters) would fail again, and a programming error (KeyError, AttributeError,
AssertionError, ...) would too. Retrying one request keeps the turns an agent loop already
made, so a multi-turn rollout does not start over.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import (
    LocalRayletDiedError,
    NodeDiedError,
    ObjectLostError,
    ObjectStoreFullError,
    RayActorError,
    RayTaskError,
    WorkerCrashedError,
)
from ray.exceptions import OutOfMemoryError as RayOutOfMemoryError

from generation_core.serving.turn_log import ENGINE_TIMING_KEY, Turn, current_log

logger = logging.getLogger(__name__)


class RequestTimeout(TimeoutError):
    """One engine request took longer than generation.request_timeout."""


# What may pass if the same request is sent again. Ray re-raises an actor's exception as a
# subclass of both RayTaskError and the original type, so an engine's error keeps its type here.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    # Connections and timeouts: OSError's ConnectionError family (a remote server that is down,
    # answered 5xx or 429: engines.remote.RemoteServerUnavailable; an engine that shut down under
    # the request: engines.base.EngineStopped) and TimeoutError (RequestTimeout, Ray's GetTimeoutError).
    ConnectionError,
    TimeoutError,
    # A replica actor that died or is restarting (ActorDiedError, ActorUnavailableError), or the
    # worker, node or object store under it; the routing client sends the retry elsewhere.
    RayActorError,
    WorkerCrashedError,
    NodeDiedError,
    LocalRayletDiedError,
    ObjectLostError,
    ObjectStoreFullError,
    RayOutOfMemoryError,
    # An engine's internal failure (engines.base.EngineStepFailed: the whole batch step failed,
    # whichever request caused it; a CUDA error; torch.OutOfMemoryError): the retry runs in
    # another batch or on another replica.
    RuntimeError,
)
PROGRAMMING_ERRORS: tuple[type[BaseException], ...] = (NotImplementedError, RecursionError)
"""RuntimeError subclasses that are bugs, not engine trouble: never retried."""


def is_transient(exc: BaseException) -> bool:
    """Whether sending the same request again may succeed."""
    # A RayTaskError whose cause's type Ray could not subclass: judge the cause.
    if (
        isinstance(exc, RayTaskError)
        and not isinstance(exc, TRANSIENT_ERRORS)
        and getattr(exc, "cause", None) is not None
    ):
        exc = exc.cause
    if isinstance(exc, PROGRAMMING_ERRORS):
        return False
    return isinstance(exc, TRANSIENT_ERRORS)


@dataclass
class RequestStats:
    requests: int = 0
    retries: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class RetryingClient:
    """Delegates to `client`; `generate` gets retries, backoff and an optional timeout."""

    def __init__(self, client: Any, *, retries: int, backoff_seconds: float, timeout: float | None):
        self.client = client
        self.retries = retries
        self.backoff_seconds = backoff_seconds
        self.timeout = timeout
        self.stats = RequestStats()

    def __getattr__(self, name: str) -> Any:
        # Anything else verl reads from its client (tokenizer for traces, ...) comes from the real one.
        return getattr(self.client, name)

    async def generate(self, request_id: str, **kwargs: Any):
        log = current_log()
        # Outside a streaming worker's sample (library use) the turn is noted nowhere.
        turn = log.begin_turn() if log is not None else Turn(start=0.0)
        started = time.perf_counter()
        try:
            output = await self._generate(request_id, **kwargs)
        finally:
            turn.seconds = time.perf_counter() - started
        _note_output(turn, output)
        return output

    async def _generate(self, request_id: str, **kwargs: Any):
        self.stats.requests += 1
        attempt = 0
        while True:
            try:
                call = self.client.generate(request_id, **kwargs)
                if self.timeout is None:
                    return await call
                try:
                    return await asyncio.wait_for(call, self.timeout)
                except TimeoutError:
                    raise RequestTimeout(
                        f"engine request {request_id} took longer than generation.request_timeout={self.timeout}s"
                    ) from None
            except Exception as exc:  # noqa: BLE001 - classified by is_transient below
                kind = type(exc).__name__
                self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
                if attempt >= self.retries or not is_transient(exc):
                    self.stats.failed += 1
                    raise
                attempt += 1
                self.stats.retries += 1
                log = current_log()
                if log is not None:
                    log.retries += 1
                # Full jitter: replicas that failed together are not hit again in lockstep.
                delay = self.backoff_seconds * (2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                logger.warning(
                    "engine request %s failed (%s: %s); retry %d/%d in %.2fs",
                    request_id,
                    kind,
                    str(exc).splitlines()[0] if str(exc) else "",
                    attempt,
                    self.retries,
                    delay,
                )
                await asyncio.sleep(delay)


def _note_output(turn: Turn, output: Any) -> None:
    """What the turn's answer tells: why it stopped, its tokens, the engine's own timing (taken
    off the output: agent loops copy extra_fields into the trajectory)."""
    turn.stop_reason = getattr(output, "stop_reason", None)
    turn.tokens = len(getattr(output, "token_ids", None) or [])
    extra = getattr(output, "extra_fields", None)
    if isinstance(extra, dict):
        engine = extra.pop(ENGINE_TIMING_KEY, None)
        if isinstance(engine, dict):
            turn.engine = engine
