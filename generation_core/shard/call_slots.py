"""Model-call slots: `generation.max_inflight` bounds the model calls a shard has in flight, not
its trajectories.

A multi-turn trajectory spends part of its life outside the engine: in a tool call, in its
reward function, between turns. Were it to hold an engine slot all along (one slot per open
trajectory, as a plain semaphore around the agent loop does), the engine would starve while the
tools sleep. Here a trajectory holds a slot only for the duration of one model call:

- `CallSlots` hands out at most `limit` slots; a call that finds none free waits, and a freed
  slot goes to the longest-waiting later turn of a started trajectory before any first turn
  (first turns keep their arrival order, so none waits forever: a later turn exists only after
  its first turn ran). This is the client's half of what the `hf` engine's
  `engine_kwargs.hf.later_turns_first` does inside the engine (engines/hf/admission.py); it acts
  with every engine, SGLang and vLLM included.
- `SlottedClient` wraps the agent loops' llm client: every `generate` takes a slot first.
  Which sample a call belongs to comes from a context variable the shard's stream sets in each
  sample's task (`sample_context`), so a later turn is recognised whatever request ids the agent
  loop sends, and calls from tasks a loop spawns itself count for their sample too.
- `OpenSamples`, the stream's open trajectories (shard/sample_stream.py), starts a new one only
  while `spare` is positive: fewer calls in flight, waiting or about to be made (started samples
  that made no call yet) than slots. Trajectories in tools therefore let new ones start, up to
  `generation.max_open_trajectories`, and a later turn back from its tool is never queued
  behind a trajectory started after it. Both limits follow the shard's share of the run's
  in-flight budget as it grows (`follow_share`, shard/progress_board.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)

SampleKey = tuple[int, int]

_current_sample: contextvars.ContextVar[SampleKey | None] = contextvars.ContextVar(
    "genrun_current_sample", default=None
)


@contextmanager
def sample_context(key: SampleKey) -> Iterator[None]:
    """Inside: model calls count for sample `key` (set in the sample's own task)."""
    token = _current_sample.set(key)
    try:
        yield
    finally:
        _current_sample.reset(token)


class CallSlots:
    """At most `limit` model calls in flight; a freed slot goes to later turns first."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"CallSlots needs a limit >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self._later: deque[asyncio.Future] = deque()
        self._first: deque[asyncio.Future] = deque()
        self._starting: set[SampleKey] = set()
        self._called: set[SampleKey] = set()
        self.freed = asyncio.Event()
        """Set when a release leaves a spare slot (the stream may start a new trajectory); the stream clears it."""
        self.peak_in_flight = 0
        self.calls = 0
        self.later_turn_calls = 0

    # ---- the stream's side -----------------------------------------------------------------

    def sample_started(self, key: SampleKey) -> None:
        """A sample's task was started: it is about to make its first call."""
        self._starting.add(key)

    def sample_ended(self, key: SampleKey) -> None:
        """A sample finished, failed or was cancelled."""
        self._starting.discard(key)
        self._called.discard(key)

    @property
    def waiting(self) -> int:
        return len(self._later) + len(self._first)

    @property
    def spare(self) -> int:
        """Slots that neither a call in flight, a waiting call nor a started sample's first call
        will take: how many new trajectories may start now."""
        return self.limit - self.in_flight - self.waiting - len(self._starting)

    def set_limit(self, limit: int) -> None:
        """Change how many calls may be in flight (the run's in-flight share, job.py): a higher
        limit hands the new slots to waiting calls at once; a lower one lets the calls in flight
        finish and hands out no slot until fewer than `limit` are."""
        self.limit = max(1, limit)
        self._hand_out()

    # ---- the calls' side ---------------------------------------------------------------------

    def is_later_turn(self) -> bool:
        """Whether the current task's sample made a model call before (marking that it has)."""
        key = _current_sample.get()
        if key is None:
            return False
        later = key in self._called
        self._called.add(key)
        self._starting.discard(key)
        return later

    async def acquire(self, later_turn: bool) -> None:
        """Take a slot, waiting for one when none is free or an earlier-ranked call waits."""
        self.calls += 1
        self.later_turn_calls += int(later_turn)
        ahead = self._later if later_turn else (self._later or self._first)
        if self.in_flight < self.limit and not ahead:
            self._take()
            return
        waiter = asyncio.get_running_loop().create_future()
        (self._later if later_turn else self._first).append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # Handed the slot just as the call was cancelled: pass it on.
                self.release()
            else:
                queue = self._later if later_turn else self._first
                # A release may have dropped it already (it skips waiters cancelled meanwhile).
                if waiter in queue:
                    queue.remove(waiter)
            raise

    def release(self) -> None:
        """Give a slot back: to the next waiting later turn, else first turn, else free (kept
        free while more calls are in flight than a lowered limit allows)."""
        self.in_flight -= 1
        self._hand_out()

    def _hand_out(self) -> None:
        """Free slots to waiting calls, later turns first (cancelled waiters skipped), then tell
        the stream when one is left over. Calls wait only while every slot is taken, so after a
        release this hands out exactly the one slot it freed."""
        while self.in_flight < self.limit and (self._later or self._first):
            waiter = (self._later or self._first).popleft()
            if not waiter.done():
                self._take()
                waiter.set_result(None)
        if self.spare > 0:
            self.freed.set()

    def _take(self) -> None:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)


class SlottedClient:
    """The agent loops' llm client: each `generate` holds one of `slots` while it runs (no slots:
    calls pass straight through, as outside a shard's stream)."""

    def __init__(self, client: Any):
        self.client = client
        self.slots: CallSlots | None = None

    def __getattr__(self, name: str) -> Any:
        # Anything else verl reads from its client comes from the one underneath.
        return getattr(self.client, name)

    async def generate(self, request_id: str, **kwargs: Any):
        slots = self.slots
        if slots is None:
            return await self.client.generate(request_id, **kwargs)
        await slots.acquire(slots.is_later_turn())
        try:
            return await self.client.generate(request_id, **kwargs)
        finally:
            slots.release()


class OpenSamples:
    """A stream's open samples: their tasks and deadlines, and which pending sample starts when.
    `run_one(key, kwargs)` runs one sample; each gets `sample_timeout` seconds from its start."""

    def __init__(
        self,
        pending: Iterator[tuple[SampleKey, dict[str, Any]]],
        slots: CallSlots,
        limit: int,
        run_one: Callable[[SampleKey, dict[str, Any]], Awaitable[Any]],
        sample_timeout: float,
    ):
        self.pending, self.slots, self.limit = pending, slots, limit
        self.run_one, self.sample_timeout = run_one, sample_timeout
        self.own_limits = (slots.limit, limit)
        """(model calls, open samples): the shard's own, before any share of the run's budget."""
        self.tasks: dict[asyncio.Future, tuple[SampleKey, float]] = {}
        """Each sample's task -> (its key, its deadline on the monotonic clock)."""
        self.exhausted = False
        """Every pending sample has started (a freed slot then has nothing new to start: the stream
        stops waking for it)."""

    def __len__(self) -> int:
        return len(self.tasks)

    def follow_share(self, factor: float) -> None:
        """Both limits at `factor` (>= 1) times the shard's own: its share of the run's
        in-flight budget (shard/progress_board.py)."""
        calls, samples = (round(own * max(factor, 1.0)) for own in self.own_limits)
        if calls != self.slots.limit:
            logger.debug(
                "model calls in flight: at most %d (was %d; x%.2f, the shard's share of the run's budget)",
                calls,
                self.slots.limit,
                factor,
            )
            self.slots.set_limit(calls)
            self.limit = samples

    def refill(self) -> None:
        """Start samples while a model-call slot would otherwise go unused, up to `limit` open.
        With nothing open, one starts whatever the slots say (a cancelled sample may not have
        given its slot back yet): the stream never ends with samples left."""
        while len(self.tasks) < self.limit and (self.slots.spare > 0 or not self.tasks):
            try:
                key, kwargs = next(self.pending)
            except StopIteration:
                self.exhausted = True
                return
            self.slots.sample_started(key)
            self.tasks[asyncio.ensure_future(self.run_one(key, kwargs))] = (key, time.monotonic() + self.sample_timeout)

    def seconds_to_next_deadline(self) -> float:
        return max(0.0, min(deadline for _, deadline in self.tasks.values()) - time.monotonic())

    def expired(self, done: set[asyncio.Future]) -> list[asyncio.Future]:
        """The open samples past their deadline that did not finish (`done`)."""
        now = time.monotonic()
        return [task for task, (_, deadline) in self.tasks.items() if task not in done and deadline <= now]

    def close(self, task: asyncio.Future) -> SampleKey:
        """The sample of `task` is no longer open (finished, failed or past its deadline)."""
        key, _ = self.tasks.pop(task)
        self.slots.sample_ended(key)
        return key

    async def cancel_all(self) -> None:
        """Cancel what is still open (the stream ended early) and wait for it to end."""
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
