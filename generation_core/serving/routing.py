"""One routing client over inference backends: verl's routing policy, run in each shard worker,
with failover.

verl's AgentLoopWorker takes the `RoutingClient` as its llm client: it only calls
`await client.generate(request_id, *, prompt_ids, sampling_params, **kw) -> TokenOutput`. The
client picks a backend per request and hands the call on:
- sticky per request id (LRU): a multi-turn request's turns reuse one server's prefix cache;
- otherwise replica_loads.ReplicaChooser picks, by `generation.routing`: the least-loaded
  backend by the load every shard worker shares, the n samples of a prompt on one backend
  (`prefix_affinity`, the default), or by the shared load alone (`least_loaded`), or the fewest
  requests outstanding from this worker (`local`); hash routing under
  `rollout.full_determinism` (as verl's GlobalRequestLoadBalancer);
- failover: a backend that fails under a request (its `server_failures`) leaves the rotation at
  once (the request fails with a transient error, and RetryingClient sends it again, to another
  backend) and is probed in the background; it comes back when its probe answers, or stays out
  when it is gone for good (`ServerGone`, or not back within REPLICA_RECOVERY_SECONDS). With no
  backend up, requests wait for one to come back; with every backend gone, they fail.

The backends and their contract are in backends.py (`Backend`, `BackendSource`, and
`RayReplicaBackend`, the server actor of a booted verl replica).

The client does not subclass verl's LLMServerClient: that class's `generate` is acquire,
`server.generate.remote(...)`, release, which fits only Ray handles (an HTTP server would have
to pose as one) and asks the balancer actor twice for every request (two of the three Ray calls
a turn would cost). What verl's client adds to every output (min/max_global_steps) and its
rollout trace stay here, for every backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import Mapping
from typing import Any

from cachetools import LRUCache
from omegaconf import DictConfig
from verl.utils.rollout_trace import rollout_trace_op
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE

from generation_core.config.settings import GenerationSettings
from generation_core.engines.request_batching import LoadReport
from generation_core.errors import GenrunError
from generation_core.serving.backends import Backend, BackendSource, ServerGone, as_token_output
from generation_core.serving.replica_loads import LOAD_REFRESH_SECONDS, ReplicaChooser, ReplicaLoads
from generation_core.serving.turn_log import note_replica

logger = logging.getLogger(__name__)

# How long a request waits for a failed backend to come back (Ray restarts a crashed engine
# actor, which loads the model again) when no other backend is up.
REPLICA_RECOVERY_SECONDS = 900.0


class RoutingClient:
    """Routes each request to one backend of `source`; see the module docstring."""

    def __init__(
        self,
        config: DictConfig,
        source: BackendSource,
        *,
        routing: str | None = None,
        chooser: ReplicaChooser | None = None,
    ):
        self.config = config
        self._source = source
        self._full_determinism = bool(config.actor_rollout_ref.rollout.get("full_determinism", False))
        self._backends: Mapping[str, Backend] | None = None
        self._connecting: asyncio.Future | None = None
        self.chooser = chooser or ReplicaChooser(routing or GenerationSettings.of(config).routing)
        self.loads = ReplicaLoads([])
        """Each backend's load as this client sees it (replica_loads.py)."""
        self._refresher: asyncio.Task | None = None
        self._sticky: LRUCache = LRUCache(maxsize=DEFAULT_ROUTING_CACHE_SIZE)
        self._down: dict[str, asyncio.Task] = {}
        self._gone: set[str] = set()
        self.replica_failures = 0
        """Server failures seen by this client (each took a backend out of rotation)."""

    # ---- what callers see ------------------------------------------------------------------

    async def connect(self, wait_seconds: float = 0.0) -> None:
        """Find the backends (a first request does it too); with `wait_seconds`, wait that long
        for them (shard workers start while the driver is still loading the model)."""
        if self._backends is not None:
            return
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect(wait_seconds))
        # Concurrent first requests share one connect; a failed one is tried again next time.
        try:
            await asyncio.shield(self._connecting)
        except BaseException:
            self._connecting = None
            raise

    @rollout_trace_op
    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        server_id = await self._acquire(request_id, prompt_ids)
        note_replica(server_id)
        backend = self._connected[server_id]
        try:
            output = await backend.generate(
                request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs
            )
        except backend.server_failures as exc:
            self._take_out_of_rotation(server_id, exc)
            raise
        finally:
            self.loads.answered(server_id)
        output = as_token_output(output)
        # What verl's LLMServerClient adds to every output (its agent loops read them).
        global_steps = output.extra_fields.get("global_steps")
        output.extra_fields.setdefault("min_global_steps", global_steps)
        output.extra_fields.setdefault("max_global_steps", global_steps)
        return output

    async def aclose(self) -> None:
        """Stop the background probes and release the backends' connections."""
        probes = list(self._down.values()) + ([self._refresher] if self._refresher is not None else [])
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        await self._source.aclose()

    @property
    def down(self) -> frozenset[str]:
        """Servers out of rotation and being probed."""
        return frozenset(self._down)

    @property
    def gone(self) -> frozenset[str]:
        """Servers out of rotation for good."""
        return frozenset(self._gone)

    def server_of(self, request_id: str) -> str | None:
        """The server a request id sticks to (its last turn went there)."""
        return self._sticky.get(request_id)

    # ---- routing ---------------------------------------------------------------------------

    @property
    def _connected(self) -> Mapping[str, Backend]:
        """The backends, for the paths that run after a connect (a request connects first)."""
        assert self._backends is not None, "not connected yet"
        return self._backends

    async def _connect(self, wait_seconds: float) -> None:
        backends, unanswered = await self._source.connect(wait_seconds)
        if not backends:
            raise GenrunError("the inference pool has no replicas")
        self.loads = ReplicaLoads(list(backends))
        self._backends = backends
        if self.chooser.shares_load:
            for server_id, backend in backends.items():
                if hasattr(backend, "watch_load"):
                    backend.watch_load(self._load_report(server_id))
            # Once at connect: a new shard worker's first requests do not go blind.
            await self._read_loads(list(backends))
            self._refresher = asyncio.ensure_future(self._refresh_loads())
        for server_id, why in unanswered.items():
            self._take_out_of_rotation(server_id, why)

    async def _acquire(self, request_id: str, prompt_ids: list[int]) -> str:
        if self._backends is None:
            await self.connect()
        up = await self._up_servers()
        server_id = self._sticky.get(request_id)
        if server_id is None or server_id not in up:
            if self._full_determinism:
                server_id = up[stable_hash(request_id) % len(up)]
            else:
                server_id = self.chooser.choose(up, self.loads, prompt_ids)
            self._sticky[request_id] = server_id
        self.loads.sent(server_id)
        return server_id

    def _load_report(self, server_id: str) -> LoadReport:
        return lambda load, answered: self.loads.report(server_id, load, answered)

    async def _refresh_loads(self) -> None:
        """Ask the replicas this client has not heard from lately for their load, while it has
        requests out (their answers tell it otherwise)."""
        while True:
            await asyncio.sleep(LOAD_REFRESH_SECONDS)
            if not self.loads.outstanding:
                continue
            quiet = [
                sid
                for sid in self.loads.quiet(list(self._connected), LOAD_REFRESH_SECONDS)
                if sid not in self._down and sid not in self._gone
            ]
            await self._read_loads(quiet)

    async def _read_loads(self, server_ids: list[str]) -> None:
        """Ask these servers for their load, all at once (a second at most)."""
        await asyncio.gather(*[self._read_load(sid) for sid in server_ids])

    async def _read_load(self, server_id: str) -> None:
        read = getattr(self._connected[server_id], "read_load", None)
        if read is None:
            return
        with contextlib.suppress(Exception):  # a server that fails is the requests' business (failover)
            async with asyncio.timeout(1.0):
                load = await read()
            if load is not None:
                self.loads.report(server_id, load)

    async def _up_servers(self) -> list[str]:
        while True:
            up = [sid for sid in self._connected if sid not in self._down and sid not in self._gone]
            if up:
                return up
            if len(self._gone) == len(self._connected):
                raise GenrunError(
                    f"every inference replica of the pool died ({len(self._connected)}); the shard stops and its retry resumes from the checkpoint"
                )
            await asyncio.sleep(0.5)

    # ---- failover --------------------------------------------------------------------------

    def _take_out_of_rotation(self, server_id: str, exc: BaseException) -> None:
        if server_id in self._down or server_id in self._gone:
            return
        self.replica_failures += 1
        logger.warning(
            "inference replica %s failed under a request (%s); its requests go to the other replicas until it is back",
            server_id,
            type(exc).__name__,
        )
        self._down[server_id] = asyncio.ensure_future(self._wait_for_recovery(server_id))

    async def _wait_for_recovery(self, server_id: str) -> None:
        backend = self._connected[server_id]
        deadline = time.monotonic() + REPLICA_RECOVERY_SECONDS
        try:
            while True:
                # asyncio.timeout, not wait_for: wait_for (3.11) swallows a cancellation (aclose)
                # that arrives as the probe answers.
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.1)):
                    if await backend.probe():
                        break
                if time.monotonic() >= deadline:
                    raise TimeoutError()
                await asyncio.sleep(backend.probe_interval)
            logger.warning("inference replica %s is back in rotation", server_id)
        except (TimeoutError, ServerGone) as exc:
            why = type(exc.__cause__).__name__ if isinstance(exc, ServerGone) else "no answer in time"
            self._gone.add(server_id)
            logger.error(
                "inference replica %s is gone for good (%s); %d of %d replicas left",
                server_id,
                why,
                len(self._connected) - len(self._gone),
                len(self._connected),
            )
        finally:
            self._down.pop(server_id, None)


def stable_hash(request_id: str) -> int:
    """A request id's hash, the same in every process (Python's `hash` of a str is salted per
    process: two shard workers would route one id to different replicas)."""
    return zlib.crc32(request_id.encode())
