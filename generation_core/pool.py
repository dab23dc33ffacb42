"""The inference replica pool: boot once per run, attach by name from any process, tear down.

Booting goes through verl's LLMServerManager, so `rollout.name=hf` (CPU or GPU), `sglang` and
`vllm` take one path; `remote` boots nothing and routes to servers that already run, through
the same routing and failover code. Two changes: the load balancer actor gets a name, so shard tasks running in
other Ray workers can attach to the pool booted by the driver instead of loading the model again;
and requests are routed inside each shard worker (`LocalRoutingClient`) instead of by two calls
to that actor per request, which were two thirds of the Ray calls a trajectory cost.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from cachetools import LRUCache
from omegaconf import DictConfig
from ray.exceptions import ActorUnavailableError, RayActorError
from verl.workers.rollout.llm_server import LLMServerClient, LLMServerManager
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE, GlobalRequestLoadBalancer

from generation_core.engines.layout import REMOTE_ENGINE, check_cluster_resources, check_engine_installed, resolve_layout
from generation_core.engines.remote import CompletionsServer, RemoteServerUnavailable, check_servers, open_servers, remote_settings
from generation_core.engines.replicas import GENRUN_ENGINES  # importing registers hf and instant with verl
from generation_core.errors import GenrunError

logger = logging.getLogger(__name__)

LOAD_BALANCER_PREFIX = "genrun_load_balancer"


class ServerRegistry(GlobalRequestLoadBalancer):
    """verl's balancer actor, which also hands out its server handles so that shard workers
    can route requests themselves."""

    def server_handles(self) -> dict[str, Any]:
        return dict(self._servers)


# How long a request waits for a failed replica to come back (Ray restarts a crashed engine
# actor, which loads the model again) when no other replica is up.
REPLICA_RECOVERY_SECONDS = 900.0


class LocalRoutingClient(LLMServerClient):
    """verl's LLMServerClient with verl's routing policy run in this process: sticky per
    request id (multi-turn requests reuse the replica's prefix cache), otherwise the replica
    with the fewest requests outstanding from this worker; hash routing under
    `rollout.full_determinism`. One Ray call per request (the engine's) instead of three.

    Failover: a replica whose actor dies under a request is taken out of rotation at once (the
    request fails with a transient error and RetryingClient sends it again, to another replica)
    and probed in the background; it comes back when Ray has restarted it, or stays out when it
    is gone for good. With no replica up, requests wait for one to come back."""

    def __init__(self, config: DictConfig, load_balancer_handle=None, balancer_name: str | None = None):
        super().__init__(config=config, load_balancer_handle=load_balancer_handle)
        self._balancer_name = balancer_name
        self._servers: dict[str, Any] | None = None
        self._inflight: dict[str, int] = {}
        self._sticky = LRUCache(maxsize=DEFAULT_ROUTING_CACHE_SIZE)
        self._full_determinism = bool(config.actor_rollout_ref.rollout.get("full_determinism", False))
        self._down: dict[str, asyncio.Task] = {}
        self._gone: set[str] = set()
        self.replica_failures = 0
        """Replica failures seen by this client (each took a replica out of rotation)."""

    async def connect(self, wait_seconds: float = 0.0) -> None:
        """Find the pool's replicas; with `wait_seconds`, wait that long for the pool to be
        booted (shard workers start while the driver is still loading the model)."""
        if self._servers is not None:
            return
        deadline = time.monotonic() + wait_seconds
        while self._load_balancer is None:
            try:
                self._load_balancer = ray.get_actor(self._balancer_name)
            except ValueError:
                if time.monotonic() >= deadline:
                    raise GenrunError(
                        f"the run's inference pool {self._balancer_name!r} is not running in this Ray namespace"
                        + (f" after waiting {wait_seconds:.0f} s" if wait_seconds else "")
                        + "; the flow run's log says why the replicas did not boot (or were torn down)"
                    ) from None
                await asyncio.sleep(0.5)
        servers = await self._load_balancer.server_handles.remote()
        if not servers:
            raise GenrunError("the inference pool has no replicas")
        self._inflight = {server_id: 0 for server_id in servers}
        self._servers = servers

    # Errors that say the replica (not the request) failed: it leaves the rotation.
    SERVER_FAILURES: tuple[type[BaseException], ...] = (RayActorError,)

    async def generate(self, request_id, **kwargs):
        try:
            return await super().generate(request_id, **kwargs)
        except self.SERVER_FAILURES as exc:
            # The sticky entry names the replica this request went to.
            server_id = self._sticky.get(request_id)
            if server_id is not None:
                self._take_out_of_rotation(server_id, exc)
            raise

    async def aclose(self) -> None:
        """Release what the client holds in this event loop (nothing for Ray handles)."""

    def _take_out_of_rotation(self, server_id: str, exc: BaseException) -> None:
        if server_id in self._down or server_id in self._gone:
            return
        self.replica_failures += 1
        logger.warning(
            "inference replica %s failed under a request (%s); its requests go to the other replicas until it is back",
            server_id, type(exc).__name__,
        )
        self._down[server_id] = asyncio.ensure_future(self._wait_for_recovery(server_id))

    async def _back_in_service(self, server_id: str, deadline: float) -> None:
        """Return when the replica serves again; raise when it never will (or not by `deadline`)."""
        while True:
            try:
                await asyncio.wait_for(self._servers[server_id].__ray_ready__.remote(), max(deadline - time.monotonic(), 0.1))
                return
            except ActorUnavailableError:
                # Restarting (the engine loads its model again): ask again shortly.
                if time.monotonic() >= deadline:
                    raise asyncio.TimeoutError() from None
                await asyncio.sleep(1.0)

    async def _wait_for_recovery(self, server_id: str) -> None:
        deadline = time.monotonic() + REPLICA_RECOVERY_SECONDS
        try:
            await self._back_in_service(server_id, deadline)
            logger.warning("inference replica %s is back in rotation", server_id)
        except (RayActorError, asyncio.TimeoutError) as exc:
            # ActorDiedError: out of restarts (or killed on purpose); it never comes back.
            self._gone.add(server_id)
            logger.error("inference replica %s is gone for good (%s); %d of %d replicas left", server_id, type(exc).__name__, len(self._servers) - len(self._gone), len(self._servers))
        finally:
            self._down.pop(server_id, None)

    async def _up_servers(self) -> list[str]:
        while True:
            up = [sid for sid in self._servers if sid not in self._down and sid not in self._gone]
            if up:
                return up
            if len(self._gone) == len(self._servers):
                raise GenrunError(f"every inference replica of the pool died ({len(self._servers)}); the shard stops and its retry resumes from the checkpoint")
            await asyncio.sleep(0.5)

    async def _acquire_server(self, request_id: str, **extra) -> tuple[str, Any]:
        if self._servers is None:
            await self.connect()
        up = await self._up_servers()
        server_id = self._sticky.get(request_id)
        if server_id is None or server_id not in up:
            if self._full_determinism:
                server_id = up[hash(request_id) % len(up)]
            else:
                fewest = min(self._inflight[sid] for sid in up)
                server_id = random.choice([sid for sid in up if self._inflight[sid] == fewest])
            self._sticky[request_id] = server_id
        self._inflight[server_id] += 1
        return server_id, self._servers[server_id]

    def _release_server(self, server_id: str, request_id: str | None = None) -> None:
        if self._inflight.get(server_id, 0) > 0:
            self._inflight[server_id] -= 1


class RemoteRoutingClient(LocalRoutingClient):
    """The same routing and failover over OpenAI-compatible servers that run outside the Ray
    cluster (`rollout.name=remote`): least outstanding requests from this worker, sticky
    multi-turn requests, a server that fails (no connection, 5xx) out of rotation until its
    /health answers, the request retried on another server. A 4xx fails only its sample."""

    SERVER_FAILURES = (RemoteServerUnavailable,)

    def __init__(self, config: DictConfig):
        super().__init__(config=config)
        self._health_interval = float(remote_settings(config).get("health_interval") or 5.0)
        self._connecting: asyncio.Future | None = None

    async def connect(self, wait_seconds: float = 0.0) -> None:
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect(wait_seconds))
        # Concurrent first requests share one connect; a failed one is tried again next time.
        try:
            await asyncio.shield(self._connecting)
        except BaseException:
            self._connecting = None
            raise

    async def _connect(self, wait_seconds: float) -> None:
        servers = open_servers(self.config)
        deadline = time.monotonic() + wait_seconds
        while True:
            answered = await asyncio.gather(*[self._learn_model(server) for server in servers.values()])
            if any(answered):
                break
            if time.monotonic() >= deadline:
                await next(iter(servers.values())).http.aclose()
                raise GenrunError(f"none of the {len(servers)} remote inference server(s) answers ({', '.join(servers)})")
            await asyncio.sleep(min(self._health_interval, max(deadline - time.monotonic(), 0.1)))
        self._inflight = {url: 0 for url in servers}
        self._servers = servers
        for url, ok in zip(list(servers), answered):
            if not ok:
                self._take_out_of_rotation(url, RemoteServerUnavailable(f"{url} did not answer at connect"))

    async def _learn_model(self, server: CompletionsServer) -> bool:
        if server.model is not None:
            return await server.healthy()
        try:
            models = await server.models()
        except RemoteServerUnavailable:
            return False
        if models:
            server.model = models[0]
        return bool(models)

    async def _back_in_service(self, server_id: str, deadline: float) -> None:
        server = self._servers[server_id]
        while not await self._learn_model(server):
            if time.monotonic() >= deadline:
                raise asyncio.TimeoutError()
            await asyncio.sleep(self._health_interval)

    async def aclose(self) -> None:
        if self._servers:
            await next(iter(self._servers.values())).http.aclose()


class _NamedLoadBalancerManager(LLMServerManager):
    balancer_name: str = ""

    async def _init_global_load_balancer(self) -> None:
        servers = dict(zip(self.server_addresses, self.server_handles, strict=True))
        self.global_load_balancer = (
            ray.remote(ServerRegistry)
            .options(name=self.balancer_name, num_cpus=0)
            .remote(servers=servers, max_cache_size=DEFAULT_ROUTING_CACHE_SIZE)
        )


def check_rollout_name(cfg: DictConfig) -> None:
    """The engine exists and its package is installed (before anything starts)."""
    name = cfg.actor_rollout_ref.rollout.name
    if name != REMOTE_ENGINE and name not in RolloutReplicaRegistry._registry:
        known = ", ".join(sorted([*RolloutReplicaRegistry._registry, REMOTE_ENGINE]))
        raise GenrunError(f"unknown actor_rollout_ref.rollout.name={name!r}; known engines: {known}")
    check_engine_installed(name)


@dataclass
class ReplicaPool:
    """The booted replicas of one run (owned by the process that booted them)."""

    manager: LLMServerManager | None
    """None for remote servers: nothing was booted."""
    config: DictConfig
    balancer_name: str

    @classmethod
    async def boot(cls, cfg: DictConfig, balancer_name: str | None = None) -> "ReplicaPool":
        check_rollout_name(cfg)
        balancer_name = balancer_name or new_balancer_name()
        layout = resolve_layout(cfg)
        if layout.engine == REMOTE_ENGINE:
            models = await check_servers(cfg)
            logger.info("inference: %s, model %s", layout.describe(), next(iter(models.values())))
            return cls(None, cfg, balancer_name)
        # A placement group the cluster cannot satisfy waits forever: refuse first.
        check_cluster_resources(layout, ray.cluster_resources())
        logger.info("inference: %s", layout.describe())
        manager_cls = type("_Manager", (_NamedLoadBalancerManager,), {"balancer_name": balancer_name})
        manager = await manager_cls.create(cfg)
        pool = cls(manager, cfg, balancer_name)
        await pool.check_health()
        return pool

    def client(self) -> LLMServerClient:
        if self.manager is None:
            return RemoteRoutingClient(self.config)
        return LocalRoutingClient(self.config, self.manager.global_load_balancer)

    async def check_health(self) -> list[dict]:
        if self.manager is None or self.config.actor_rollout_ref.rollout.name not in GENRUN_ENGINES:
            return []
        return await asyncio.gather(*[handle.health.remote() for handle in self.manager.server_handles])

    def shutdown(self) -> None:
        if self.manager is None:
            return
        for handle in [*self.manager.server_handles, self.manager.global_load_balancer]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - teardown goes on for the other actors
                logger.warning("could not stop actor %s: %s", handle, exc)


def new_balancer_name() -> str:
    # A fresh name per boot: a pool torn down a moment ago may still hold its old name.
    return f"{LOAD_BALANCER_PREFIX}_{uuid.uuid4().hex[:8]}"


def attach_client(cfg: DictConfig, balancer_name: str) -> LocalRoutingClient:
    """A client for the pool that another process of this Ray job boots or has booted; it
    finds the pool at `connect()` (or its first request). Remote servers need no pool."""
    if cfg.actor_rollout_ref.rollout.name == REMOTE_ENGINE:
        return RemoteRoutingClient(cfg)
    return LocalRoutingClient(cfg, balancer_name=balancer_name)
