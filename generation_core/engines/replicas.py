"""Our engines as verl RolloutReplicas (`hf`, `instant`), each served by one Ray actor.

Registering them in verl's RolloutReplicaRegistry lets verl's own LLMServerManager boot them
and the routing client (routing.py) call their server actors exactly as it calls `sglang` and
`vllm` replicas: the CPU tests exercise the same pool and client code as production GPU runs.
An EngineServer serves the engine contract (engines/base.py) of the engine it holds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Callable

import ray
import torch
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry

from generation_core.engines import hf, instant
from generation_core.engines.base import Engine
from generation_core.instrumentation import mark
from generation_core.request_batching import serve_batch

logger = logging.getLogger(__name__)

ENGINE_RESTARTS = 3


class EngineServer:
    """Ray actor body: one engine, many concurrent `generate` calls (an async actor)."""

    def __init__(self, build_engine: Callable[[], Engine]):
        # Runs again when Ray restarts a crashed engine actor.
        _run_at_normal_priority()
        self.engine = build_engine()
        mark("replica_ready")

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        return await self.engine.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)

    async def serve_batch(self, requests: list[dict]):
        """Many `generate` calls in one Ray call, answered as they finish (request_batching.py)."""
        async for answers in serve_batch(self.generate, requests):
            yield answers

    def health(self) -> dict:
        return dict(self.engine.stats, pid=os.getpid(), nice=os.getpriority(os.PRIO_PROCESS, 0), torch_threads=torch.get_num_threads())

    # verl's replica API: weights never change during generation, so these are no-ops.
    async def wake_up(self):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    def shutdown(self) -> None:
        self.engine.shutdown()


def _run_at_normal_priority() -> None:
    """Ray starts its worker processes at nice 15, the engine's actor included: on a busy machine
    the engine, whose batch steps are the run's throughput, would lose the CPU to the shard
    workers, Prefect and Ray's daemons. Back to nice 0 where the process may (root, or
    CAP_SYS_NICE); otherwise it stays where Ray put it, level with the shard workers."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except (PermissionError, AttributeError):  # AttributeError: no setpriority on this platform
        logger.info("the engine process keeps nice %d (raising its priority needs CAP_SYS_NICE)", os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0)


def cpu_threads_per_replica(replicas_on_node: int) -> int:
    """Torch threads of one CPU engine replica: the CPUs this process may use (its affinity
    mask, which containers and taskset narrow) shared by the replicas of its node; more threads
    than cores only make the replicas preempt each other mid-matmul."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    return max(1, usable // max(1, replicas_on_node))


class _EngineReplica(RolloutReplica):
    """A verl replica whose server is one EngineServer actor; standalone mode only."""

    engine_name = ""

    def build_engine(self) -> Callable[[], Engine]:
        raise NotImplementedError

    def gpus(self) -> int:
        """GPUs the engine actor holds (Ray then sets its CUDA_VISIBLE_DEVICES)."""
        return 0

    async def init_standalone(self):
        self.rollout_mode = RolloutMode.STANDALONE
        name = f"genrun_{self.engine_name}_server_{self.replica_rank}{self.name_suffix}_{uuid.uuid4().hex[:8]}"
        # num_cpus=0: the engine sizes its own threads, and holding a Ray CPU would starve the
        # shard tasks on a small machine. A GPU engine holds its GPU, so Ray places it on a GPU node. max_restarts: a crashed engine process is started
        # again (model loaded again) under the same handle; the clients fail over meanwhile.
        # No task retries: the clients resend a failed request themselves.
        server = (
            ray.remote(EngineServer)
            .options(name=name, num_cpus=0, num_gpus=self.gpus(), max_concurrency=self.max_concurrency, max_restarts=ENGINE_RESTARTS, max_task_retries=0)
            .remote(self.build_engine())
        )
        await server.health.remote()
        self._server_handle = server
        self._server_address = name
        self.servers = [server]

    async def launch_servers(self):
        raise NotImplementedError(f"the {self.engine_name} engine runs standalone only (a generation run)")


class HFReplica(_EngineReplica):
    engine_name = "hf"

    def gpus(self) -> int:
        return int(self._device().startswith("cuda"))

    def _device(self) -> str:
        hf_kwargs = self.config.engine_kwargs.get("hf", {}) or {}
        # RolloutConfig has no trainer.device: the driver's resolution (layout.hf_device) put it here.
        return hf_kwargs.get("device") or "cpu"

    def build_engine(self) -> Callable[[], Engine]:
        hf_kwargs = dict(self.config.engine_kwargs.get("hf", {}) or {})
        device = self._device()
        # bfloat16 on a GPU (what SGLang/vLLM serve), float32 on the CPU (bf16 matmuls are slow there).
        dtype = hf_kwargs.get("dtype") or ("bfloat16" if device.startswith("cuda") else "float32")
        prefix_cache_bytes = hf_kwargs.get("prefix_cache_bytes")
        settings = hf.EngineSettings(
            model_path=os.path.expanduser(self.model_config.path),
            prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
            max_batch_size=self.config.max_num_seqs,
            max_step_tokens=int(self.config.max_num_batched_tokens),
            num_threads=hf_kwargs.get("num_threads"),
            device=device,
            dtype=dtype,
            ignore_eos=bool(hf_kwargs.get("ignore_eos", False)),
            prefix_cache_bytes=hf.EngineSettings.prefix_cache_bytes if prefix_cache_bytes is None else int(prefix_cache_bytes),
            trust_remote_code=bool(self.model_config.get("trust_remote_code", False)),
            later_turns_first=bool(hf_kwargs.get("later_turns_first", hf.EngineSettings.later_turns_first)),
            shared_prefix_attention=bool(hf_kwargs.get("shared_prefix_attention", hf.EngineSettings.shared_prefix_attention)),
        )
        # verl's gpus_per_node (trainer.n_gpus_per_node): the CPU replicas a node holds.
        replicas_on_node = self.gpus_per_node
        # Sized where it runs: the actor's node, not the driver's.
        return lambda: hf.HFEngine(dataclasses.replace(settings, num_threads=settings.num_threads or cpu_threads_per_replica(replicas_on_node)))


class InstantReplica(_EngineReplica):
    engine_name = "instant"

    def build_engine(self) -> Callable[[], Engine]:
        instant_kwargs = dict(self.config.engine_kwargs.get("instant", {}) or {})
        model_config = json.loads((Path(os.path.expanduser(self.model_config.path)) / "config.json").read_text())
        eos = model_config.get("eos_token_id", 2)
        settings = instant.InstantSettings(
            prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            response_tokens=int(instant_kwargs.get("response_tokens", 8)),
            delay_seconds=float(instant_kwargs.get("delay_seconds", 0.0)),
            vocab_size=int(model_config.get("vocab_size", 1000)),
        )
        return lambda: instant.InstantEngine(settings)


GENRUN_ENGINES = {"hf": HFReplica, "instant": InstantReplica}
for _name, _replica in GENRUN_ENGINES.items():
    RolloutReplicaRegistry.register(_name, lambda replica=_replica: replica)
