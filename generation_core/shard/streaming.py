"""Streaming agent-loop worker: verl's AgentLoopWorker, one trajectory handed on as it finishes.

verl's `generate_sequences` gathers a whole batch before returning; a generation pipeline must
not wait for its slowest sample. This worker keeps verl's AgentLoopWorker for everything it
sets up (tokenizer, tools, the agent-loop registry including `agent_loop_config_path` loops),
runs each sample's agent loop (`AgentLoopBase.run`) with at most `max_inflight` model calls in
flight (a trajectory in its tool or reward function holds none: shard/call_slots.py), and yields
each result the moment it completes (shard/sample_stream.py's `SampleStream`: slots, deadlines),
as an unpadded record: verl's per-sample padding is skipped because the merge pads once, exactly
as verl's postprocessing does (tested).

Agent loops are built the way verl's `_run_agent_loop` builds them, with three shortcuts: a
registry entry that is only a class (what `@register` writes) is constructed directly instead of
through `hydra.utils.instantiate`, which took most of the orchestration time of a sample;
every agent loop of a worker shares one Continuous Token builder
(`verl_adapter.share_continuous_token_builders`); and verl's own single-turn and tool loops,
which keep no sample's state on themselves, are built once and copied for each sample.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Sized
from importlib import metadata
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from verl.experimental.agent_loop import AgentLoopWorker

from generation_core.config.settings import GenerationSettings
from generation_core.inputs.images import png_bytes, stored_messages, vision_info
from generation_core.inputs.openai_batch import line_sampling_params
from generation_core.inputs.tokenizer import run_processor
from generation_core.serving.request_retry import RetryingClient
from generation_core.serving.routing import RoutingClient
from generation_core.serving.turn_log import start_trajectory
from generation_core.shard.call_slots import SampleKey, SlottedClient, sample_context
from generation_core.shard.rewards import NO_SCORE, RewardScorer
from generation_core.shard.sample_stream import SampleStream
from generation_core.store.trajectory_record import SampleFailure, TrajectoryRecord
from generation_core.verl_adapter import (
    agent_loop_arguments,
    agent_loop_entry,
    equip_worker_for_images,
    keeps_no_sample_state,
    rebind_worker_client,
    share_continuous_token_builders,
)

logger = logging.getLogger(__name__)


def sample_seed(base: int, key: SampleKey) -> int:
    """The seed of every request of one sample: stable across processes and runs (no hash()),
    different for each (index, rollout_n), within the 31 bits every engine accepts."""
    digest = hashlib.sha256(f"{base}:{key[0]}:{key[1]}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


# verl's AgentLoopWorker of the run this process last served. Building one loads the tokenizer,
# processor, tools and agent-loop YAML again (1.4-2 s): a Ray worker process runs shard after
# shard of the same run, and each takes the one built for the first.
_cached_worker: tuple[str, AgentLoopWorker] | None = None


def _agent_loop_worker(cfg: DictConfig, client) -> AgentLoopWorker:
    """The process's AgentLoopWorker for `cfg` (built at its first shard), talking to `client`."""
    global _cached_worker
    # Before any agent loop of this process is built (see the module's docstring).
    share_continuous_token_builders()
    key = OmegaConf.to_yaml(cfg, resolve=True)
    if _cached_worker is None or _cached_worker[0] != key:
        worker = AgentLoopWorker(cfg, client)
        processor = run_processor(cfg.actor_rollout_ref.model)
        if processor is not None:
            # verl's own processor is None for a VL folder here (no torchvision): genrun's, and its image reader.
            equip_worker_for_images(worker, processor, vision_info)
        _cached_worker = (key, worker)
        return worker
    worker = _cached_worker[1]
    rebind_worker_client(worker, client)
    return worker


class StreamingWorker:
    """The shard job's worker (shard/protocols.py's StreamWorker) over verl's agent loops."""

    postprocess_seconds: float = 0.0
    """Seconds spent turning agent-loop outputs into records (the shard's stage breakdown)."""

    def __init__(
        self,
        cfg: DictConfig,
        llm_client,
        reward_scorer: RewardScorer | None = None,
        *,
        settings: GenerationSettings | None = None,
    ):
        """`settings`: the run's (RunPlan.settings); None, for a caller without a plan: from `cfg`."""
        gen = settings if settings is not None else GenerationSettings.of(cfg)
        # Agent loops reach the engine only through this client: every model turn gets retries.
        self.client = RetryingClient(
            llm_client,
            retries=gen.request_retries,
            backoff_seconds=gen.request_backoff_seconds,
            timeout=gen.request_timeout,
        )
        # ...and each of its calls holds one of the stream's model-call slots (shard/call_slots.py).
        self.slotted_client = SlottedClient(self.client)
        self.worker = _agent_loop_worker(cfg, self.slotted_client)
        self.reward_scorer = reward_scorer
        rollout = cfg.actor_rollout_ref.rollout
        # The same sampling parameters verl's generate_sequences sends for a training step.
        self.sampling_params = dict(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            repetition_penalty=1.0,
            logprobs=rollout.calculate_log_probs,
        )
        if rollout.ignore_eos:
            # verl's key, sent with every request so that every engine honours it (verl's vLLM
            # server reads it from its config, its SGLang server does not).
            self.sampling_params["ignore_eos"] = True
        self.sample_seed = gen.sample_seed
        self.provenance: dict[str, Any] = {
            "engine": str(rollout.name),
            "engine_version": engine_version(str(rollout.name)),
            "model_digest": None,
            "sampling_digest": hashlib.sha256(
                json.dumps(self.sampling_params, sort_keys=True, default=str).encode()
            ).hexdigest()[:16],
            "attempt": None,
        }
        """What every trajectory of this worker shares (trajectory_record.PROVENANCE_KEYS); the shard job
        sets the model digest and its attempt number."""
        # agent name -> (class, plain arguments), or None where hydra must build it.
        self._direct_construction: dict[str, tuple[type, dict[str, Any]] | None] = {}
        self._arguments: dict[str, Any] | None = None
        # (agent name, event loop) -> a built loop that keeps no sample's state, copied per sample
        # (its constructor read the OmegaConf config about ten times: most of a sample's cost in genrun).
        self._reusable_loops: dict[tuple[str, asyncio.AbstractEventLoop], Any] = {}
        timeout = gen.sample_timeout_seconds
        self.samples = SampleStream(
            self.run_one, float("inf") if timeout is None else float(timeout), self.slotted_client
        )
        """Every sample of its streams runs through `run_one` here (slots, deadlines)."""
        # The routing client (serving/routing.py) counts the replicas that failed under a
        # request; an engine called directly (library use, tests) has no replicas to fail over.
        self._routing = llm_client if isinstance(llm_client, RoutingClient) else None

    def stream(
        self,
        samples: Iterable[tuple[SampleKey, dict[str, Any]]],
        max_inflight: int,
        idle_timeout: float,
        max_open: int | None = None,
        scale: Callable[[], float] | None = None,
    ) -> AsyncGenerator[TrajectoryRecord | SampleFailure | None, None]:
        """`run_one` for each of `samples` as they stream (`SampleStream.stream`)."""
        return self.samples.stream(samples, max_inflight, idle_timeout, max_open, scale)

    @property
    def peak_calls_in_flight(self) -> int:
        return self.samples.peak_calls_in_flight

    @property
    def open_samples(self) -> Sized:
        return self.samples.open_samples

    def engine_counters(self) -> dict[str, int]:
        """Requests sent, requests sent again, replicas that failed under a request (so far)."""
        stats = self.client.stats
        replica_failures = self._routing.replica_failures if self._routing is not None else 0
        return {"requests": stats.requests, "request_retries": stats.retries, "replica_failures": replica_failures}

    def shutdown(self) -> None:
        if self.reward_scorer is not None:
            self.reward_scorer.shutdown()

    def build_agent_loop(self, agent_name: str):
        """A fresh agent loop for one sample, with the arguments verl's AgentLoopWorker passes.
        A loop that keeps no sample's state on itself (verl_adapter.keeps_no_sample_state) is
        built once per event loop and copied for each sample."""
        built = self._reusable_loops.get((agent_name, asyncio.get_running_loop()))
        if built is not None:
            return copy.copy(built)
        if self._arguments is None:
            # The same for every sample of this worker: read once, not once per sample.
            self._arguments = agent_loop_arguments(self.worker)
        config = agent_loop_entry(agent_name)
        if agent_name not in self._direct_construction:
            self._direct_construction[agent_name] = _plain_class_entry(config)
        direct = self._direct_construction[agent_name]
        if direct is None:
            return hydra.utils.instantiate(config=config, **self._arguments)
        agent_class, plain_arguments = direct
        agent_loop = agent_class(**plain_arguments, **self._arguments)
        if keeps_no_sample_state(agent_class):
            self._reusable_loops[(agent_name, asyncio.get_running_loop())] = agent_loop
        return agent_loop

    async def run_one(self, key: SampleKey, kwargs: dict[str, Any]) -> TrajectoryRecord:
        sample_kwargs = dict(kwargs)
        agent_loop = self.build_agent_loop(sample_kwargs.pop("agent_name"))
        sampling_params = dict(self.sampling_params)
        # An OpenAI batch line's own parameters (inputs/openai_batch.py); its seed, like
        # generation.sample_seed, seeds each of the line's samples differently.
        own = line_sampling_params(kwargs)
        seed = own.pop("seed", self.sample_seed)
        sampling_params.update(own)
        if seed is not None:
            sampling_params["seed"] = sample_seed(seed, key)
        # This sample's task only: the request clients note each turn in it (serving/turn_log.py).
        log = start_trajectory()
        with sample_context(key):
            output = await agent_loop.run(sampling_params, **sample_kwargs)
        started = time.perf_counter()
        record = self.record_from_output(key, output, kwargs)
        self.postprocess_seconds += time.perf_counter() - started
        reward_seconds = None
        # A score the agent loop set itself (e.g. from its tools) is kept, as verl keeps it.
        if self.reward_scorer is not None and record.reward_score is None:
            started = time.perf_counter()
            reward = await self.reward_scorer.score(record.response_ids, kwargs, record.num_turns, record.extra_fields)
            if reward is not NO_SCORE:  # verl's default scorer has none for this data_source
                reward_seconds = round(time.perf_counter() - started, 6)
                record.reward_score = reward.score
                record.extra_fields["reward_extra_info"] = reward.extra_info
        record.provenance = dict(
            self.provenance,
            seed=sampling_params.get("seed"),
            retries=log.retries,
            started_at=round(log.started_at, 6),
            turns=[turn.as_dict() for turn in log.turns],
        )
        tools = record.metrics.get("tool_calls")
        record.timings = dict(
            log.time_split(), tools=None if tools is None else round(float(tools), 6), reward=reward_seconds
        )
        return record

    @staticmethod
    def record_from_output(key: SampleKey, output, kwargs: dict[str, Any]) -> TrajectoryRecord:
        """The unpadded record of one AgentLoopOutput; `kwargs` are the sample's dataset fields."""
        extra_fields = dict(output.extra_fields)
        images = (output.multi_modal_data or {}).get("images")
        inputs = dict(kwargs)
        if images:
            # The images apart, once per prompt in a part; image parts of the messages (raw_prompt,
            # and the prompt column verl's dataset filled in place) as {"type": "image"}.
            inputs = {key: stored_messages(value) for key, value in kwargs.items()}
        # verl's per-sample postprocessing adds the chat messages to extra_fields.
        extra_fields["raw_prompt"] = inputs["raw_prompt"]
        return TrajectoryRecord(
            index=key[0],
            rollout_n=key[1],
            prompt_ids=[int(t) for t in output.prompt_ids],
            response_ids=[int(t) for t in output.response_ids],
            response_mask=[int(m) for m in output.response_mask],
            response_logprobs=None
            if output.response_logprobs is None
            else [float(v) for v in output.response_logprobs],
            reward_score=None if output.reward_score is None else float(output.reward_score),
            num_turns=int(output.num_turns),
            input_fields=inputs,
            extra_fields=extra_fields,
            metrics=output.metrics.model_dump(),
            images=[png_bytes(image) for image in images] if images else None,
        )


def engine_version(engine: str) -> str:
    """The version of the package that serves `engine` in this process's environment
    (transformers for hf, genrun for the instant and remote engines); "unknown" when absent."""
    package = {"hf": "transformers", "sglang": "sglang", "vllm": "vllm"}.get(engine, "genrun")
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def _plain_class_entry(config) -> tuple[type, dict[str, Any]] | None:
    """(class, arguments) for a registry entry hydra would only call with plain values; None for
    anything else (nested configs, _partial_, ...), which stays with hydra.instantiate."""
    entry = dict(config)
    target = entry.pop("_target_", None)
    if not isinstance(target, str) or any(name.startswith("_") for name in entry):
        return None
    if not all(isinstance(value, str | int | float | bool) or value is None for value in entry.values()):
        return None
    return hydra.utils.get_class(target), entry
