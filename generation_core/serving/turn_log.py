"""What each model turn of one trajectory cost and where it ran, written down as it happens.

verl's agent loop makes the turns; genrun sees each one pass through its clients
(request_retry.RetryingClient: timing and retries; routing.RoutingClient: the replica). A
trajectory's `TurnLog` rides along in a context variable that the streaming worker sets for each
sample's task (shard/streaming.py), so no agent-loop argument changes. Engines that know more
(the hf engine: how long a request waited for a batch slot, its prefill, a prefix-cache hit) say
so in the output's `extra_fields` under ENGINE_TIMING_KEY, which is taken off before the agent
loop sees the output.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from generation_core.engines.base import TURN_TIMING_KEY as ENGINE_TIMING_KEY

__all__ = ["ENGINE_TIMING_KEY", "Turn", "TurnLog", "current_log", "note_replica", "start_trajectory"]


@dataclass
class Turn:
    """One model turn (one engine request, retries included)."""

    start: float
    """Seconds after the trajectory's start."""
    replica: str | None = None
    seconds: float = 0.0
    stop_reason: str | None = None
    tokens: int = 0
    engine: dict[str, Any] = field(default_factory=dict)
    """The engine's own account (ENGINE_TIMING_KEY), when it gives one."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "stop_reason": self.stop_reason,
            "start": round(self.start, 6),
            "seconds": round(self.seconds, 6),
            "tokens": self.tokens,
            **self.engine,
        }


@dataclass
class TurnLog:
    """The turns of one trajectory so far."""

    started_at: float = field(default_factory=time.time)
    """Unix seconds."""
    started: float = field(default_factory=time.perf_counter)
    turns: list[Turn] = field(default_factory=list)
    retries: int = 0
    current: Turn | None = None

    def begin_turn(self) -> Turn:
        self.current = Turn(start=time.perf_counter() - self.started)
        self.turns.append(self.current)
        return self.current

    def time_split(self) -> dict[str, float | None]:
        """slot_wait, prefill (None unless every turn's engine reported them) and decode (the
        rest of the turns' time) in seconds."""
        split: dict[str, float | None] = {}
        for name in ("slot_wait", "prefill"):
            known = [float(t.engine[name]) for t in self.turns if t.engine.get(name) is not None]
            split[name] = round(sum(known), 6) if self.turns and len(known) == len(self.turns) else None
        spent = sum(t.seconds for t in self.turns)
        split["decode"] = round(max(spent - (split["slot_wait"] or 0.0) - (split["prefill"] or 0.0), 0.0), 6)
        return split


_CURRENT: ContextVar[TurnLog | None] = ContextVar("genrun_turn_log", default=None)


def start_trajectory() -> TurnLog:
    """A fresh log for the trajectory the calling task runs (and the tasks it starts)."""
    log = TurnLog()
    _CURRENT.set(log)
    return log


def current_log() -> TurnLog | None:
    return _CURRENT.get()


def note_replica(server_id: str) -> None:
    """The routing client sent the current turn to `server_id` (the last answer counts)."""
    log = _CURRENT.get()
    if log is not None and log.current is not None:
        log.current.replica = server_id
