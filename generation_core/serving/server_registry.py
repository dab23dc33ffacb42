"""The pool's named registry actor: it hands out the replicas' server handles.

Shard workers find the pool by this actor's name and route their requests themselves
(routing.RoutingClient), so the actor routes nothing (verl's load balancer, which it replaced,
routed nothing here either). It keeps the handles as one object in Ray's store and never opens
it: a process that unpickles an actor handle imports the module of the actor's class (the
engines, and with them verl, torch and transformers: ~8 CPU-seconds on 2 cores, spent while
the replicas load). So this module imports nothing heavy, and only the shard workers, which
import all of that anyway, open the object.
"""

from __future__ import annotations

from typing import Any

import ray


def start_server_registry(name: str, servers: dict[str, Any]) -> Any:
    """Start the named registry of `servers` (server id -> actor handle); returns its handle."""
    # In a list, so that Ray passes the reference as it is instead of resolving it for the actor.
    return ray.remote(ServerRegistry).options(name=name, num_cpus=0).remote([ray.put(servers)])


async def fetch_server_handles(registry: Any) -> dict[str, Any]:
    """The server handles a registry holds, opened in this process."""
    (servers,) = await registry.servers.remote()
    return await servers


class ServerRegistry:
    """Holds the reference to the replicas' server handles, as booted."""

    def __init__(self, servers: list[ray.ObjectRef]):
        self._servers = servers

    def servers(self) -> list[ray.ObjectRef]:
        return self._servers
