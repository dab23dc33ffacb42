"""Boot `rollout.name=sglang` replicas through genrun's pool and verl's real standalone placement on
a Ray cluster with 4 logical GPUs, with SGLang's server process replaced by genrun's instant
engine (neither SGLang nor a GPU exists on the CPU test machines). Run as a script by
test_gpu_layout.py (it needs a Ray of its own, with GPUs declared); prints one JSON line.

What is real: ReplicaPool.boot, the layout check, verl's LLMServerManager and
RolloutReplica.init_standalone (ResourcePoolManager, placement groups of GPU bundles,
RayWorkerGroup with use_gpu=True), the routing client, the shard-task resources. What stands in:
the replica's worker class and its server actor (verl's SGLangReplica would start
sglang.launch_server there).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


class StandInRolloutWorker:
    """Where verl's replica workers run (one per GPU): reports what Ray gave it."""

    def __init__(self, rollout_config=None, model_config=None, replica_rank=0, **_):
        self.replica_rank = replica_rank

    def placement(self) -> dict:
        return {
            "replica": self.replica_rank,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "node_id": ray.get_runtime_context().get_node_id(),
            "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }


def stand_in_replica_class():
    from verl.single_controller.ray import RayClassWithInitArgs
    from verl.workers.rollout.replica import RolloutReplica

    from generation_core.engines.instant import InstantEngine, InstantSettings
    from generation_core.engines.server import EngineServer

    class StandInSGLangReplica(RolloutReplica):
        def get_ray_class_with_init_args(self):
            return RayClassWithInitArgs(
                cls=ray.remote(StandInRolloutWorker),
                rollout_config=None,
                model_config=None,
                replica_rank=self.replica_rank,
            )

        async def launch_servers(self):
            # Like verl's SGLangReplica: the server actor lives on the node of the replica's first worker.
            placements = await asyncio.gather(*[w.placement.remote() for w in self.workers])
            self.placements = placements
            settings = InstantSettings(
                prompt_length=self.config.prompt_length,
                response_length=self.config.response_length,
                eos_token_id=2,
                response_tokens=4,
                delay_seconds=0.0,
                vocab_size=1000,
            )
            server = (
                ray.remote(EngineServer)
                .options(
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=placements[0]["node_id"], soft=False),
                )
                .remote(lambda: InstantEngine(settings))
            )
            await server.health.remote()
            self._server_handle = server
            self._server_address = f"stand-in-sglang-{self.replica_rank}"
            self.servers = [server]

    return StandInSGLangReplica


@ray.remote
def shard_task_probe() -> dict:
    return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()], "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def main(overrides: list[str]) -> dict:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    import generation_core.serving.pool as pool_module
    from generation_core.config.layout import SHARD_TASK_RESOURCES, resolve_layout
    from generation_core.config.loading import load_config
    from generation_core.errors import GenrunError

    cfg = load_config(["actor_rollout_ref.rollout.name=sglang", *overrides])
    layout = resolve_layout(cfg)
    RolloutReplicaRegistry.register("sglang", stand_in_replica_class)
    # SGLang is not installed here; the package check is tested on its own.
    pool_module.check_engine_installed = lambda name: None

    async def boot_and_generate():
        try:
            pool = await pool_module.ReplicaPool.boot(cfg)
        except GenrunError as exc:
            return {"refused": str(exc)}
        try:
            client = pool.client()
            out = await client.generate("r0", prompt_ids=[1, 2, 3], sampling_params={"temperature": 1.0})
            replicas = pool.manager.get_replicas()
            groups = [
                [dict(b) for b in pg.bundle_specs] for r in replicas for pg in r.resource_pool.get_placement_groups()
            ]
            return {
                "replicas": len(replicas),
                "placements": [p for r in replicas for p in r.placements],
                "placement_groups_per_replica": len(groups) // max(len(replicas), 1),
                "bundles": groups[0] if groups else [],
                "tokens": out.token_ids,
                "shard_task": ray.get(shard_task_probe.options(**SHARD_TASK_RESOURCES).remote()),
            }
        finally:
            pool.shutdown()

    result = asyncio.run(boot_and_generate())
    result["layout"] = {
        "replicas": layout.replicas,
        "gpus_per_replica": layout.gpus_per_replica,
        "placement_groups": layout.placement_groups,
    }
    return result


if __name__ == "__main__":
    gpus = int(os.environ.get("CONTRACT_GPUS", "4"))
    ray.init(
        num_cpus=int(os.environ.get("CONTRACT_CPUS", "10")),
        num_gpus=gpus,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        object_store_memory=128 * 1024 * 1024,
        log_to_driver=False,
    )
    try:
        print("CONTRACT " + json.dumps(main(sys.argv[1:])), flush=True)
    finally:
        ray.shutdown()
