"""Engine requests that survive transient failures: retries with backoff and a timeout.

Agent loops talk to the engine through one call, `await client.generate(request_id, ...)`.
`RetryingClient` wraps the routing client (or any object with that method) and retries a
request that failed for a reason that may pass (the replica actor died or restarted, the call
timed out, a connection dropped, the engine raised an internal error) with exponential backoff.
A request the engine rejected as invalid (ValueError/TypeError: a prompt beyond the context,
bad sampling parameters) fails at once: sending it again would fail again. Retrying one
request keeps the turns an agent loop already made, so a multi-turn rollout does not start over.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


class RequestTimeout(TimeoutError):
    """One engine request took longer than generation.request_timeout."""


def is_transient(exc: BaseException) -> bool:
    """Whether sending the same request again may succeed."""
    # Ray re-raises an actor's exception as a subclass of both RayTaskError and the original
    # type, so an engine's ValueError is still a ValueError here.
    if isinstance(exc, ValueError | TypeError):
        return False
    return isinstance(exc, Exception)


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
        self.stats.requests += 1
        attempt = 0
        while True:
            try:
                call = self.client.generate(request_id, **kwargs)
                if self.timeout is None:
                    return await call
                try:
                    return await asyncio.wait_for(call, self.timeout)
                except asyncio.TimeoutError:
                    raise RequestTimeout(f"engine request {request_id} took longer than generation.request_timeout={self.timeout}s") from None
            except Exception as exc:  # noqa: BLE001 - classified by is_transient below
                kind = type(exc).__name__
                self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
                if attempt >= self.retries or not is_transient(exc):
                    self.stats.failed += 1
                    raise
                attempt += 1
                self.stats.retries += 1
                # Full jitter: replicas that failed together are not hit again in lockstep.
                delay = self.backoff_seconds * (2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                logger.warning("engine request %s failed (%s: %s); retry %d/%d in %.2fs", request_id, kind, str(exc).splitlines()[0] if str(exc) else "", attempt, self.retries, delay)
                await asyncio.sleep(delay)
