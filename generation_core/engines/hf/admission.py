"""Which waiting request joins the decode batch next: later turns of trajectories first.

A multi-turn trajectory (a tool call, then the tool's reply, then the model again) sends its
next turn only after the previous one finished. In arrival order, that next turn waits behind
every first turn queued meanwhile (up to max_inflight - max_num_seqs of them per shard; the
shard's model-call slots, shard/call_slots.py, order their own queue the same way), so the
multi-turn trajectories finish last and the end of a run decodes their remaining turns in a
nearly empty batch. Taking later turns first keeps trajectories moving once they started; first
turns keep arrival order among themselves, so none waits forever (a later turn exists only
after its first turn ran). Measured on the bundled tool example (192 prompts, 2 cores), the
two orders ran at the same rate (0.99 once the setting acted, bench/RESULTS.md); longer
multi-turn runs are not measured.

A later turn is recognised by its trajectory key: verl's agent loops send every turn of one
trajectory under the same id (which also keeps it on one replica, with its KV), and the routing
client hands it to our engines as `trajectory_key` (the request id a replica gets is fresh per
turn: verl's servers need unique ids); without a key, the request id stands in.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict, deque
from typing import Any

# Request ids remembered (LRU), far more than the trajectories in flight at once on a replica.
REMEMBERED_REQUEST_IDS = 65536


class AdmissionQueue(queue.Queue):
    """A queue.Queue (blocking, thread-safe) whose items have a bool `later_turn`: those come out first."""

    def _init(self, maxsize: int) -> None:
        self.later_turns: deque[Any] = deque()
        self.first_turns: deque[Any] = deque()

    def _qsize(self) -> int:
        return len(self.later_turns) + len(self.first_turns)

    def _put(self, item: Any) -> None:
        (self.later_turns if item.later_turn else self.first_turns).append(item)

    def _get(self) -> Any:
        return (self.later_turns or self.first_turns).popleft()

    def peek(self) -> Any | None:
        """The item `get` would return next, left in the queue; None when empty."""
        with self.mutex:
            waiting = self.later_turns or self.first_turns
            return waiting[0] if waiting else None

    def take(self, item: Any) -> None:
        """Remove `item`, which `peek` returned. Still at the head of its own deque, even if a later
        turn arrived since (puts append; only the one consumer removes)."""
        with self.mutex:
            waiting = self.later_turns if item.later_turn else self.first_turns
            if not waiting or waiting[0] is not item:
                raise RuntimeError("AdmissionQueue.take: the item is not at the head of the queue (a second consumer?)")
            waiting.popleft()
            self.not_full.notify()


class RequestIds:
    """The trajectory keys (or request ids) an engine has seen: whether a request continues a trajectory."""

    def __init__(self, capacity: int = REMEMBERED_REQUEST_IDS):
        self._capacity = capacity
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def seen_before(self, request_id: str) -> bool:
        """Whether `request_id` came before (remembering it either way)."""
        with self._lock:
            if request_id in self._seen:
                self._seen.move_to_end(request_id)
                return True
            self._seen[request_id] = None
            if len(self._seen) > self._capacity:
                self._seen.popitem(last=False)
            return False
