"""Many engine requests per Ray call: a client-side batcher and the server method it calls.

One Ray actor call per model turn costs the shard worker ~1 ms of Python (submit, then the
reply's bookkeeping): a bare loop of calls to an engine that answers at once tops out at
580-825 requests/s on 2 cores, so a shard could never pass that rate whatever the engine. The
batcher collects the requests a worker makes within `linger_seconds` (or until `max_batch`) and
sends them in one call to `serve_batch` on the replica, a streaming generator method: the
replica runs them concurrently and yields each group of completions as it finishes, so a short
answer never waits for a long one in the same call.

Every request keeps its own outcome: an engine's error for one request (an invalid prompt, a
failed batch step) comes back as that request's exception, of the type the engine raised; a
failure of the call itself (the actor died) fails every request of the call with it, which the
routing client treats as the server's failure (backends.RayReplicaBackend.server_failures).

A replica (server.EngineServer) sends its load, the requests it still holds, with each group of
answers; the batcher hands it to `on_load` (the routing client's shared load,
serving/replica_loads.py).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

LoadReport = Callable[[int, int], None]
"""(the replica's load after a group of answers, how many answers the group held)."""

logger = logging.getLogger(__name__)

BATCH_METHOD = "serve_batch"
"""The replica method that takes a batch (engines/replicas.EngineServer has it; verl's SGLang
and vLLM servers do not, and get one call per request)."""

LINGER_SECONDS = 0.002
"""How long the first request of a batch waits for others: far below a model turn, long enough
for a worker's agent loops (their tokenization finishes in threads, one by one) to join."""
MAX_BATCH = 128


class EngineCallFailed(RuntimeError):
    """A batched call ended without answering some of its requests (the replica's generator
    stopped early); they may succeed when sent again."""


async def serve_batch(generate: Callable[..., Awaitable[Any]], requests: list[dict[str, Any]]):
    """The server side: run `generate(**request)` for every request concurrently and yield lists of
    (position, output, error) as they finish. Ray actor methods wrap this async generator."""
    tasks = {asyncio.ensure_future(generate(**request)): position for position, request in enumerate(requests)}
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            answers: list[tuple[int, Any, BaseException | None]] = []
            for task in done:
                position = tasks.pop(task)
                if task.cancelled():
                    answers.append((position, None, EngineCallFailed("the replica cancelled this request")))
                    continue
                error = task.exception()
                answers.append((position, None if error else task.result(), _sendable(error)))
            yield answers
    finally:
        for task in tasks:
            task.cancel()


def _sendable(error: BaseException | None) -> BaseException | None:
    """The error as it can cross to the caller: itself when it pickles, else a RuntimeError naming it
    (an unpicklable exception would fail the whole yield, i.e. every request of the batch)."""
    if error is None:
        return None
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001 - whatever pickling raises, the error is described instead
        return RuntimeError(f"{type(error).__name__}: {error}")


class RequestBatcher:
    """The client side, one per replica handle and event loop: `call(request)` -> that request's output."""

    def __init__(
        self,
        handle: Any,
        *,
        linger_seconds: float = LINGER_SECONDS,
        max_batch: int = MAX_BATCH,
        on_load: LoadReport | None = None,
    ):
        self._method = getattr(handle, BATCH_METHOD).options(num_returns="streaming")
        self._on_load = on_load
        self._linger_seconds = linger_seconds
        self._max_batch = max_batch
        self._pending: list[tuple[dict[str, Any], asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._calls: set[asyncio.Task] = set()

    async def call(self, request: dict[str, Any]) -> Any:
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._pending.append((request, answer))
        if len(self._pending) >= self._max_batch:
            self._send()
        elif self._timer is None:
            self._timer = loop.call_later(self._linger_seconds, self._send)
        return await answer

    def _send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.ensure_future(self._run(batch))
            # Held until done: the event loop keeps only weak references to tasks.
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def _run(self, batch: list[tuple[dict[str, Any], asyncio.Future]]) -> None:
        try:
            async for ref in self._method.remote([request for request, _ in batch]):
                answers = await ref
                if isinstance(answers, tuple):
                    # EngineServer sends its load with each group of answers (routing's shared load).
                    answers, load = answers
                    if self._on_load is not None:
                        self._on_load(load, len(answers))
                for position, output, error in answers:
                    answer = batch[position][1]
                    if answer.done():
                        continue  # the caller gave up on it (a timeout or a cancelled sample)
                    if error is not None:
                        answer.set_exception(error)
                    else:
                        answer.set_result(output)
        except BaseException as exc:  # noqa: BLE001 - the call failed: every request still waiting hears why
            for _, answer in batch:
                if not answer.done():
                    answer.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for _, answer in batch:
            if not answer.done():
                answer.set_exception(
                    EngineCallFailed("the replica ended a batched call without answering this request")
                )
