"""The inference replica pool: boot once per run, attach by name from any process, tear down.

Booting goes through verl's LLMServerManager, so `rollout.name=hf` (CPU or GPU), `instant`,
`sglang` and `vllm` take one path; `remote` boots nothing. In place of verl's load balancer
actor the manager starts a named ServerRegistry (server_registry.py), so shard tasks running in
other Ray workers attach to the pool booted by the driver instead of loading the model again;
it hands out its replicas' server handles, and each shard worker routes its own requests
(routing.RoutingClient) instead of asking a balancer actor twice per request. Which backends a
client routes over is decided in one place, `_backend_source`: the pool's replicas, or the
remote servers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from omegaconf import DictConfig
from verl.workers.rollout.llm_server import LLMServerManager

from generation_core.config.layout import (
    REMOTE_ENGINE,
    check_cluster_resources,
    check_engine_installed,
    check_engine_name,
    resolve_layout,
)
from generation_core.engines.base import prefix_hit_rate
from generation_core.engines.remote import CompletionsServers, check_servers
from generation_core.engines.replicas import GENRUN_ENGINES  # importing registers hf and instant with verl
from generation_core.errors import GenrunError
from generation_core.serving.backends import BackendSource, RayReplicaBackend
from generation_core.serving.routing import RoutingClient
from generation_core.serving.server_registry import fetch_server_handles, start_server_registry
from generation_core.verl_adapter import server_manager_with_registry

logger = logging.getLogger(__name__)

REGISTRY_NAME_PREFIX = "genrun_server_registry"


class PoolReplicas:
    """The pool's replicas as routing backends, found through its registry actor (the handle,
    or its name: the pool may still be booting in another process)."""

    def __init__(self, config: DictConfig, *, registry: Any = None, registry_name: str | None = None):
        self.config = config
        self._registry = registry
        self._registry_name = registry_name

    async def connect(self, wait_seconds: float = 0.0) -> tuple[dict[str, RayReplicaBackend], dict[str, BaseException]]:
        deadline = time.monotonic() + wait_seconds
        while self._registry is None:
            assert self._registry_name is not None, "PoolReplicas needs the registry or its name"
            try:
                self._registry = ray.get_actor(self._registry_name)
            except ValueError:
                if time.monotonic() >= deadline:
                    raise GenrunError(
                        f"the run's inference pool {self._registry_name!r} is not running in this Ray namespace"
                        + (f" after waiting {wait_seconds:.0f} s" if wait_seconds else "")
                        + "; the flow run's log says why the replicas did not boot (or were torn down)"
                    ) from None
                await asyncio.sleep(0.5)
        handles = await fetch_server_handles(self._registry)
        return {server_id: RayReplicaBackend(handle, self.config) for server_id, handle in handles.items()}, {}

    async def aclose(self) -> None:
        """Nothing to release: Ray handles hold no connection of this event loop."""


def _backend_source(cfg: DictConfig, *, registry: Any = None, registry_name: str | None = None) -> BackendSource:
    """The one place where `remote` differs for a client: servers from the config, not the pool."""
    if cfg.actor_rollout_ref.rollout.name == REMOTE_ENGINE:
        return CompletionsServers(cfg)
    return PoolReplicas(cfg, registry=registry, registry_name=registry_name)


def check_rollout_name(cfg: DictConfig) -> None:
    """The engine is one genrun runs (config/layout.py's list, which config loading checked already)
    and its package is installed (before anything starts)."""
    name = cfg.actor_rollout_ref.rollout.name
    check_engine_name(name)
    check_engine_installed(name)


@dataclass
class ReplicaPool:
    """The booted replicas of one run (owned by the process that booted them)."""

    manager: LLMServerManager | None
    """None for remote servers: nothing was booted."""
    config: DictConfig
    registry_name: str

    @classmethod
    async def boot(cls, cfg: DictConfig, registry_name: str | None = None) -> ReplicaPool:
        check_rollout_name(cfg)
        registry_name = registry_name or new_registry_name()
        layout = resolve_layout(cfg)
        if layout.engine == REMOTE_ENGINE:
            models = await check_servers(cfg)
            logger.info("inference: %s, model %s", layout.describe(), next(iter(models.values())))
            return cls(None, cfg, registry_name)
        # A placement group the cluster cannot satisfy waits forever: refuse first.
        check_cluster_resources(layout, ray.cluster_resources())
        logger.info("inference: %s", layout.describe())
        # The manager's load balancer is the pool's named ServerRegistry (see the module's docstring).
        manager_cls = server_manager_with_registry(functools.partial(start_server_registry, registry_name))
        manager = await manager_cls.create(cfg)
        pool = cls(manager, cfg, registry_name)
        await pool.check_health()
        return pool

    def client(self) -> RoutingClient:
        """A routing client for this process (the one that booted the pool)."""
        registry = None if self.manager is None else self.manager.global_load_balancer
        return RoutingClient(self.config, _backend_source(self.config, registry=registry))

    async def check_health(self) -> list[dict]:
        """Each genrun engine replica's counters (verl's own replicas have no health call)."""
        return await asyncio.gather(*self.health_requests())

    def health_requests(self) -> list[Any]:
        """`check_health` as Ray object refs, for a caller that must not block (the stall alarm
        reads the engines' generated_tokens); none for verl's own replicas."""
        if self.manager is None or self.config.actor_rollout_ref.rollout.name not in GENRUN_ENGINES:
            return []
        return [handle.health.remote() for handle in self.manager.server_handles]

    async def prefix_cache_report(self) -> dict[str, Any] | None:
        """The prefix cache's hit rate (prompt tokens reused / prompt tokens) per replica and for
        the run, from genrun engines' counters (the hf engine counts its own, as may a registered one);
        None where the engine counts none (instant, verl's sglang/vllm, remote)."""
        stats = await self.check_health()
        rates = [prefix_hit_rate(s) for s in stats]
        if not stats or all(rate is None for rate in rates):
            return None
        run = {
            key: sum(int(s.get(key, 0)) for s in stats)
            for key in ("prefix_reused_tokens", "shared_prefix_tokens", "prefill_tokens")
        }
        return {
            "run": prefix_hit_rate(run),
            "replicas": rates,
            "reused_tokens": run["prefix_reused_tokens"] + run["shared_prefix_tokens"],
            "prefilled_tokens": run["prefill_tokens"],
        }

    def shutdown(self) -> None:
        if self.manager is None:
            return
        for handle in [*self.manager.server_handles, self.manager.global_load_balancer]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - teardown goes on for the other actors
                logger.warning("could not stop actor %s: %s", handle, exc)


def new_registry_name() -> str:
    # A fresh name per boot: a pool torn down a moment ago may still hold its old name.
    return f"{REGISTRY_NAME_PREFIX}_{uuid.uuid4().hex[:8]}"


def attach_client(cfg: DictConfig, registry_name: str, *, routing: str | None = None) -> RoutingClient:
    """A client for the pool that another process of this Ray job boots or has booted; it
    finds the pool at `connect()` (or its first request). Remote servers need no pool.
    `routing`: the run's generation.routing as its plan carries it."""
    return RoutingClient(cfg, _backend_source(cfg, registry_name=registry_name), routing=routing)
