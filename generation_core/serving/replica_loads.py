"""Which replica takes a request: the load every shard worker shares, and prefix-affinity groups
(`generation.routing`; routing.RoutingClient asks `ReplicaChooser` for every new request).

Global load (`least_loaded`, `prefix_affinity`): each replica counts the requests it holds from
every shard worker (engines/server.EngineServer.outstanding) and sends that count with every
group of answers it streams back (engines/request_batching), so a routing client hears a
replica's load each time it gets answers from it, for no call of its own. Between two reports
the client adds what it sent there since and takes off what came back: estimate = reported +
(this client's outstanding now - its outstanding at the report). A replica this client has not
heard from within LOAD_REFRESH_SECONDS while it has requests out is asked (`read_load`, off the
request path: one call per quiet replica per interval, never one per request). Backends that
report no load (verl's sglang and vllm servers, remote URLs) count as this client's own
outstanding requests there, as with `local`.

Prefix-affinity groups (`prefix_affinity`): the first request with a given prompt picks the
least-loaded replica, and every later request with the same prompt (the other n-1 samples of
the prompt: one shard holds them all) goes to the same one while it is up, so its prefix cache
prefills the prompt once; every later turn of a trajectory follows its first (the routing
client's sticky request ids). Picking the least-loaded replica per group, not per request, keeps
the replicas level to within a group's size.

`local` is genrun's routing before issue 34: the fewest requests outstanding from this worker.
"""

from __future__ import annotations

import array
import asyncio
import random
import time
import zlib
from collections.abc import Sequence

from cachetools import LRUCache

from generation_core.config.settings import ROUTING_MODES

LOAD_REFRESH_SECONDS = 0.05
"""How old a replica's last reported load may be while this client has requests out before the
client asks for it."""

GROUP_CACHE_SIZE = 10_000
"""Prompts whose replica a client remembers (a shard's samples of one prompt arrive together)."""


class ReplicaLoads:
    """Each replica's load as one routing client estimates it (see the module docstring)."""

    def __init__(self, server_ids: Sequence[str]):
        self.mine: dict[str, int] = {sid: 0 for sid in server_ids}
        """Requests outstanding from this client, per replica."""
        self._reported: dict[str, tuple[int, int, float]] = {}
        """server id -> (its load, this client's outstanding there then, when)."""

    def sent(self, server_id: str) -> None:
        self.mine[server_id] += 1

    def answered(self, server_id: str) -> None:
        self.mine[server_id] -= 1

    def report(self, server_id: str, load: int, answered: int = 0) -> None:
        """The replica's own count, sent after `answered` answers this client has not counted off yet."""
        self._reported[server_id] = (int(load), self.mine[server_id] - answered, _now())

    def estimate(self, server_id: str) -> int:
        mine = self.mine[server_id]
        reported = self._reported.get(server_id)
        if reported is None:
            return mine
        load, mine_then, _ = reported
        return max(mine, load + mine - mine_then)

    def quiet(self, server_ids: Sequence[str], older_than: float) -> list[str]:
        """The replicas whose last report is older than `older_than` seconds (or that never reported)."""
        now = _now()
        return [sid for sid in server_ids if sid not in self._reported or now - self._reported[sid][2] > older_than]

    @property
    def outstanding(self) -> int:
        return sum(self.mine.values())


class ReplicaChooser:
    """The replica for a request that sticks to none yet, by `generation.routing`."""

    def __init__(self, mode: str, rng: random.Random | None = None):
        if mode not in ROUTING_MODES:
            raise ValueError(f"unknown routing mode {mode!r}; known: {', '.join(ROUTING_MODES)}")
        self.mode = mode
        self.shares_load = mode != "local"
        self._rng = rng or random.Random()
        self._groups: LRUCache = LRUCache(maxsize=GROUP_CACHE_SIZE)

    def choose(self, up: Sequence[str], loads: ReplicaLoads, prompt_ids: Sequence[int]) -> str:
        """One of the replicas `up` (in rotation) for a request whose prompt is `prompt_ids`."""
        key = prompt_key(prompt_ids) if self.mode == "prefix_affinity" else None
        if key is not None:
            grouped: str | None = self._groups.get(key)
            if grouped is not None and grouped in up:
                return grouped
        server_id = self.least_loaded(up, loads)
        if key is not None:
            self._groups[key] = server_id
        return server_id

    def least_loaded(self, up: Sequence[str], loads: ReplicaLoads) -> str:
        """The replica with the least load (shared, or this client's own for `local`); ties at random."""
        load = {sid: loads.estimate(sid) if self.shares_load else loads.mine[sid] for sid in up}
        fewest = min(load.values())
        return self._rng.choice([sid for sid in up if load[sid] == fewest])


def _now() -> float:
    """The event loop's clock (bench/sim runs loops whose clock is virtual), else monotonic."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


def prompt_key(prompt_ids: Sequence[int]) -> int:
    """The prompt's group key, the same in every process (token ids up to 2**63)."""
    return zlib.crc32(array.array("q", prompt_ids).tobytes()) ^ (len(prompt_ids) << 32)
