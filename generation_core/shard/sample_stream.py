"""A shard's samples run side by side and handed on as each finishes: the stream every worker
of a shard job streams with (shard/streaming.py's verl worker; the tests' scripted ones).

At most `max_inflight` model calls are in flight (shard/call_slots.py: later turns of started
trajectories first), a new sample starts while a slot would otherwise go unused, and each result
is yielded the moment it completes: a record, a SampleFailure for a sample that raised, or None
after `idle_timeout` seconds without either (the caller commits what it holds).

Each sample has a deadline (`generation.sample_timeout_seconds`, from its start to its score): a
sample past it is cancelled and handed on as a failure naming the sample, the deadline and the
setting, and its slot goes to the next sample at once, whether or not the cancelled code stops.
What awaits (an async tool or reward function, a thread awaited through asyncio.to_thread or the
reward pool) is bounded; the thread itself runs on, since Python cannot stop a thread, and the
shard's event loop does not wait for it at its end (`_set_aside_default_executor`). A synchronous
call that blocks the event loop itself stops every sample of the shard and cannot be bounded here.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sized
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from generation_core.instrumentation import SampleTrace
from generation_core.shard.call_slots import CallSlots, OpenSamples, SampleKey, SlottedClient
from generation_core.store.trajectory_record import TRACEBACK_CHARS, SampleFailure, TrajectoryRecord

logger = logging.getLogger(__name__)


class SampleTimedOut(TimeoutError):
    """A sample ran past generation.sample_timeout_seconds (an agent loop, tool or reward
    function that does not return)."""


class SampleStream:
    """Streams samples through `run_one(key, kwargs)` (one sample's record): see the module
    docstring. `slotted_client`: the agent loops' client, whose calls take the stream's slots."""

    def __init__(
        self,
        run_one: Callable[[SampleKey, dict[str, Any]], Awaitable[TrajectoryRecord]],
        sample_timeout: float = float("inf"),
        slotted_client: SlottedClient | None = None,
    ):
        self.run_one = run_one
        self.sample_timeout = sample_timeout
        """generation.sample_timeout_seconds: a sample's deadline from its start to its score."""
        self.slotted_client = slotted_client
        self.peak_calls_in_flight = 0
        """The most model calls its streams had in flight at once (above max_inflight only when the
        shard's share of the run's in-flight budget grew): the success marker's engine counters."""
        self.open_samples: Sized = ()
        """What its stream has open now (its len: trajectories started, not finished)."""

    async def stream(
        self,
        samples: Iterable[tuple[SampleKey, dict[str, Any]]],
        max_inflight: int,
        idle_timeout: float,
        max_open: int | None = None,
        scale: Callable[[], float] | None = None,
    ) -> AsyncGenerator[TrajectoryRecord | SampleFailure | None, None]:
        """Yield each finished record or failure as it completes, None after `idle_timeout`
        seconds without either. At most `max_inflight` model calls in flight and `max_open`
        trajectories open (None: `max_inflight`, one slot's worth each, as when a trajectory held
        its slot from start to finish). `scale`: a factor (>= 1) both limits follow, read as the
        stream goes (the shard's share of the run's in-flight budget once other shards finished)."""
        slots = CallSlots(max_inflight)
        if self.slotted_client is not None:
            self.slotted_client.slots = slots
        limit = max_inflight if max_open is None else max(max_open, max_inflight)
        open_samples = OpenSamples(iter(samples), slots, limit, self.run_one, self.sample_timeout)
        self.open_samples = open_samples
        open_samples.refill()
        trace = SampleTrace()
        freed = asyncio.ensure_future(slots.freed.wait())
        try:
            while open_samples.tasks:
                if scale is not None:
                    open_samples.follow_share(scale())
                done, _ = await asyncio.wait(
                    [*open_samples.tasks, *([] if open_samples.exhausted else [freed])],
                    timeout=min(idle_timeout, open_samples.seconds_to_next_deadline()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if freed in done:
                    # A slot came back (a trajectory went to its tool or finished): maybe start more.
                    done.discard(freed)
                    slots.freed.clear()
                    freed = asyncio.ensure_future(slots.freed.wait())
                    open_samples.refill()
                    if not done:
                        continue
                expired = open_samples.expired(done)
                if not done and not expired:
                    yield None
                    continue
                for task in expired:
                    # Its slot is free now, whether or not the cancelled code ever stops.
                    yield self._timed_out(open_samples.close(task), task)
                for task in done:
                    yield _outcome(open_samples.close(task), task, trace)
                open_samples.refill()
        finally:
            self.open_samples = ()
            self.peak_calls_in_flight = max(self.peak_calls_in_flight, slots.peak_in_flight)
            trace.close()
            freed.cancel()
            await open_samples.cancel_all()
            if self.slotted_client is not None:
                self.slotted_client.slots = None

    def _timed_out(self, key: SampleKey, task: asyncio.Future) -> SampleFailure:
        """Cancel a sample past its deadline; its failure carries where it was waiting."""
        where = _where_it_waits(task)
        task.cancel()
        task.add_done_callback(_retrieve_outcome)
        _set_aside_default_executor(asyncio.get_running_loop())
        message = (
            f"sample {key[0]}:{key[1]} did not finish within "
            f"generation.sample_timeout_seconds={self.sample_timeout:g} s "
            "(an agent loop, tool or reward function that does not return?) and was cancelled; raise "
            "generation.sample_timeout_seconds if its samples need longer"
        )
        logger.warning("%s", message)
        failure = SampleFailure.from_exception(key, SampleTimedOut(message))
        failure.traceback = where[-TRACEBACK_CHARS:]
        return failure


def _outcome(key: SampleKey, task: asyncio.Future, trace: SampleTrace) -> TrajectoryRecord | SampleFailure:
    """A finished sample's record, or its failure."""
    try:
        record = task.result()
    except Exception as exc:  # noqa: BLE001 - engine, agent loop, tool or reward: this sample's failure
        logger.warning("sample %d:%d failed: %s: %s", key[0], key[1], type(exc).__name__, exc)
        return SampleFailure.from_exception(key, exc)
    trace.finished(record.index, record.rollout_n)
    return record


def _set_aside_default_executor(loop: asyncio.AbstractEventLoop) -> None:
    """After a sample was cancelled at its deadline: a thread it started through asyncio.to_thread
    may never return, and asyncio.run joins the default executor's threads at its end, which
    would hold the finished shard there forever. The loop gets a fresh default executor; the old
    one is shut down without waiting (work already in it still runs to its end)."""
    # asyncio has no public way to read the default executor; None: no thread was ever started.
    previous = getattr(loop, "_default_executor", None)
    if previous is None:
        return
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="asyncio"))
    previous.shutdown(wait=False)


def _where_it_waits(task: asyncio.Future) -> str:
    """The chain of coroutines a pending task is suspended in, outermost first, as a traceback
    reads (Task.get_stack shows only the outermost one)."""
    frames: list[tuple[Any, int]] = []
    awaited: Any = task.get_coro() if isinstance(task, asyncio.Task) else None
    while awaited is not None and len(frames) < 200:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is None:
            break
        frames.append((frame, frame.f_lineno))
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return "Waiting at the deadline (most recent call last):\n" + "".join(
        traceback.StackSummary.extract(frames).format()
    )


def _retrieve_outcome(task: asyncio.Future) -> None:
    """Done-callback of a sample cancelled at its deadline: nobody awaits it any more."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("a sample cancelled at its deadline ended with %r", task.exception())
