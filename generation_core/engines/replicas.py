"""Our engines as verl RolloutReplicas (`hf`, `instant`), each served by one Ray actor.

Registering them in verl's RolloutReplicaRegistry lets verl's own LLMServerManager boot them
and the routing client (routing.py) call their server actors exactly as it calls `sglang` and
`vllm` replicas: the CPU tests exercise the same pool and client code as production GPU runs.
Each replica's server is an EngineServer actor (server.py); the replica hands it a builder that
makes the engine in the actor's process, a function of the engine's own module, so that the
replica process imports that engine and nothing of verl.

An engine that is not part of the product (bench/sim's simulator) is served the same way once
it calls `register_engine` with its own EngineReplica: the only hook for it here.
"""

from __future__ import annotations

import functools
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import cast

import ray
from ray.actor import ActorHandle
from verl.workers.rollout.replica import RolloutReplica

from generation_core.config.engine_kwargs import HfEngineKwargs, InstantEngineKwargs, hf_device
from generation_core.config.layout import CPU_CAPABLE_ENGINES
from generation_core.engines import instant
from generation_core.engines.base import Engine
from generation_core.engines.hf import engine as hf
from generation_core.engines.server import EngineServer
from generation_core.errors import GenrunError
from generation_core.verl_adapter import register_replica_class, registered_engine_names, serve_standalone

ENGINE_RESTARTS = 3


class EngineReplica(RolloutReplica):
    """A verl replica whose server is one EngineServer actor; standalone mode only."""

    engine_name = ""

    def build_engine(self) -> Callable[[], Engine]:
        raise NotImplementedError

    def gpus(self) -> int:
        """GPUs the engine actor holds (Ray then sets its CUDA_VISIBLE_DEVICES)."""
        return 0

    async def init_standalone(self):
        name = f"genrun_{self.engine_name}_server_{self.replica_rank}{self.name_suffix}_{uuid.uuid4().hex[:8]}"
        # num_cpus=0: the engine sizes its own threads, and holding a Ray CPU would starve the
        # shard tasks on a small machine. A GPU engine holds its GPU, so Ray places it on a GPU node. max_restarts: a crashed engine process is started
        # again (model loaded again) under the same handle; the clients fail over meanwhile.
        # No task retries: the clients resend a failed request themselves.
        server = cast(
            ActorHandle,  # what it is; ray types it as the handle or the class
            ray.remote(EngineServer)
            .options(
                name=name,
                num_cpus=0,
                num_gpus=self.gpus(),
                max_concurrency=self.max_concurrency,
                max_restarts=ENGINE_RESTARTS,
                max_task_retries=0,
            )
            .remote(self.build_engine()),
        )
        await server.health.remote()
        serve_standalone(self, server, name)

    async def launch_servers(self):
        raise NotImplementedError(f"the {self.engine_name} engine runs standalone only (a generation run)")


class HFReplica(EngineReplica):
    engine_name = "hf"

    def gpus(self) -> int:
        return int(self._device().startswith("cuda"))

    def _device(self) -> str:
        # RolloutConfig has no trainer.device: load_config wrote the decision into hf.device.
        return hf_device(HfEngineKwargs.of(self.config.engine_kwargs).device, None)

    def build_engine(self) -> Callable[[], Engine]:
        hf_kwargs = HfEngineKwargs.of(self.config.engine_kwargs)
        device = self._device()
        settings = hf.EngineSettings(
            model_path=os.path.expanduser(self.model_config.path),
            prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
            max_batch_size=self.config.max_num_seqs,
            max_step_tokens=int(self.config.max_num_batched_tokens),
            num_threads=hf_kwargs.num_threads,
            device=device,
            dtype=hf_kwargs.dtype_on(device),
            ignore_eos=bool(hf_kwargs.ignore_eos),
            prefix_cache_bytes=hf_kwargs.prefix_cache_bytes_or_default,
            trust_remote_code=bool(self.model_config.get("trust_remote_code", False)),
            later_turns_first=bool(hf_kwargs.later_turns_first),
            weight_first_linear=bool(hf_kwargs.weight_first_linear),
        )
        # verl's gpus_per_node (trainer.n_gpus_per_node): the CPU replicas a node holds.
        return functools.partial(hf.engine_on_this_node, settings, replicas_on_node=self.gpus_per_node)


class InstantReplica(EngineReplica):
    engine_name = "instant"

    def build_engine(self) -> Callable[[], Engine]:
        instant_kwargs = InstantEngineKwargs.of(self.config.engine_kwargs)
        eos, vocab_size = model_tokens(self.model_config.path)
        settings = instant.InstantSettings(
            prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
            eos_token_id=eos,
            response_tokens=int(instant_kwargs.response_tokens),
            delay_seconds=float(instant_kwargs.delay_seconds),
            vocab_size=vocab_size,
        )
        return functools.partial(instant.InstantEngine, settings)


def model_tokens(model_path: str) -> tuple[int, int]:
    """The model's EOS id and vocabulary size, from its config.json (the engines without a model
    answer in its tokens)."""
    model_config = json.loads((Path(os.path.expanduser(model_path)) / "config.json").read_text())
    eos = model_config.get("eos_token_id", 2)
    return (eos[0] if isinstance(eos, list) else eos), int(model_config.get("vocab_size", 1000))


GENRUN_ENGINES: dict[str, type[EngineReplica]] = {
    "hf": HFReplica,
    "instant": InstantReplica,
}
"""Rollout names served by an EngineServer actor (their replicas answer `health()`)."""

for _name, _replica in GENRUN_ENGINES.items():
    register_replica_class(_name, _replica)


def register_engine(name: str, replica: type[EngineReplica]) -> None:
    """Serve an engine from outside the product under `actor_rollout_ref.rollout.name=<name>`,
    exactly as genrun's own (one server actor per replica on the CPU, the same routing). Call it
    in the process that plans and drives the run, before its config loads; a name verl or genrun
    already serves is refused."""
    if name in GENRUN_ENGINES or name in registered_engine_names():
        if GENRUN_ENGINES.get(name) is replica:
            return  # registered twice (a test and a bench script in one process): the same engine
        raise GenrunError(f"rollout.name={name!r} is already an engine; register yours under another name")
    GENRUN_ENGINES[name] = replica
    CPU_CAPABLE_ENGINES.add(name)
    register_replica_class(name, replica)
