"""Streaming agent-loop worker: verl's AgentLoopWorker, one trajectory handed on as it finishes.

verl's `generate_sequences` gathers a whole batch before returning; a generation pipeline must
not wait for its slowest sample. This worker keeps verl's AgentLoopWorker for everything it
sets up (tokenizer, tools, the agent-loop registry including `agent_loop_config_path` loops),
runs each sample's agent loop (`AgentLoopBase.run`) with at most `max_inflight` model calls in
flight (a trajectory in its tool or reward function holds none: shard/call_slots.py), and yields
each result the moment it completes, as an unpadded record: verl's per-sample padding is skipped
because the merge pads once, exactly as verl's postprocessing does (tested).

Agent loops are built the way verl's `_run_agent_loop` builds them, with two shortcuts: a
registry entry that is only a class (what `@register` writes) is constructed directly instead of
through `hydra.utils.instantiate`, which cost ~7 ms per sample (most of the orchestration time);
and every agent loop of a worker shares one Continuous Token builder
(`verl_adapter.share_continuous_token_builders`).

Each sample has a deadline (`generation.sample_timeout_seconds`, from its start to its score): a
sample past it is cancelled and handed on as a failure naming the sample, the deadline and the
setting, and its slot goes to the next sample at once, whether or not the cancelled code stops.
What awaits (an async tool or reward function, a thread awaited through asyncio.to_thread or the
reward pool) is bounded; the thread itself runs on, since Python cannot stop a thread, and the
shard's event loop does not wait for it at its end (`_set_aside_default_executor`). A synchronous
call that blocks the event loop itself stops every sample of the shard and cannot be bounded here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import traceback
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Sized
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from verl.experimental.agent_loop import AgentLoopWorker

from generation_core.config.settings import GenerationSettings
from generation_core.inputs.openai_batch import line_sampling_params
from generation_core.instrumentation import SampleTrace
from generation_core.serving.request_retry import RetryingClient
from generation_core.serving.turn_log import start_trajectory
from generation_core.shard.call_slots import CallSlots, SlottedClient, sample_context
from generation_core.shard.rewards import NO_SCORE, RewardScorer
from generation_core.store.trajectory_record import TRACEBACK_CHARS, SampleFailure, TrajectoryRecord
from generation_core.verl_adapter import (
    agent_loop_arguments,
    agent_loop_entry,
    rebind_worker_client,
    share_continuous_token_builders,
)

logger = logging.getLogger(__name__)

SampleKey = tuple[int, int]


class SampleTimedOut(TimeoutError):
    """A sample ran past generation.sample_timeout_seconds (an agent loop, tool or reward
    function that does not return)."""


def _set_aside_default_executor(loop: asyncio.AbstractEventLoop) -> None:
    """After a sample was cancelled at its deadline: a thread it started through asyncio.to_thread
    may never return, and asyncio.run joins the default executor's threads at its end, which
    would hold the finished shard there forever. The loop gets a fresh default executor; the old
    one is shut down without waiting (work already in it still runs to its end)."""
    # asyncio has no public way to read the default executor; None: no thread was ever started.
    previous = getattr(loop, "_default_executor", None)
    if previous is None:
        return
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="asyncio"))
    previous.shutdown(wait=False)


def _where_it_waits(task: asyncio.Task) -> str:
    """The chain of coroutines a pending task is suspended in, outermost first, as a traceback
    reads (Task.get_stack shows only the outermost one)."""
    frames: list[tuple[Any, int]] = []
    awaited: Any = task.get_coro()
    while awaited is not None and len(frames) < 200:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is None:
            break
        frames.append((frame, frame.f_lineno))
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return "Waiting at the deadline (most recent call last):\n" + "".join(
        traceback.StackSummary.extract(frames).format()
    )


def _retrieve_outcome(task: asyncio.Task) -> None:
    """Done-callback of a sample cancelled at its deadline: nobody awaits it any more."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("a sample cancelled at its deadline ended with %r", task.exception())


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
        _cached_worker = (key, AgentLoopWorker(cfg, client))
        return _cached_worker[1]
    worker = _cached_worker[1]
    rebind_worker_client(worker, client)
    return worker


class StreamingWorker:
    postprocess_seconds: float = 0.0
    """Seconds spent turning agent-loop outputs into records (the shard's stage breakdown)."""
    sample_timeout: float = float("inf")
    """generation.sample_timeout_seconds: a sample's deadline from its start to its score."""
    slotted_client: SlottedClient | None = None
    """The agent loops' client: each model call holds one of the stream's slots."""
    peak_calls_in_flight: int = 0
    """The most model calls its streams had in flight at once (above max_inflight only when the
    shard's share of the run's in-flight budget grew): the success marker's engine counters."""
    open_samples: Sized = ()
    """What its stream has open now (its len: trajectories started, not finished)."""

    def __init__(self, cfg: DictConfig, llm_client, reward_scorer: RewardScorer | None = None):
        # A config load_config did not build gets its derived defaults here, the same ones.
        gen = GenerationSettings.of(cfg)
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
        """What every trajectory of this worker shares (records.PROVENANCE_KEYS); the shard job
        sets the model digest and its attempt number."""
        if gen.sample_timeout_seconds is not None:
            self.sample_timeout = float(gen.sample_timeout_seconds)
        # agent name -> (class, plain arguments), or None where hydra must build it.
        self._direct_construction: dict[str, tuple[type, dict[str, Any]] | None] = {}

    def shutdown(self) -> None:
        if self.reward_scorer is not None:
            self.reward_scorer.shutdown()

    def build_agent_loop(self, agent_name: str):
        """A fresh agent loop for one sample, with the arguments verl's AgentLoopWorker passes."""
        arguments = agent_loop_arguments(self.worker)
        config = agent_loop_entry(agent_name)
        if agent_name not in self._direct_construction:
            self._direct_construction[agent_name] = _plain_class_entry(config)
        direct = self._direct_construction[agent_name]
        if direct is None:
            return hydra.utils.instantiate(config=config, **arguments)
        agent_class, plain_arguments = direct
        return agent_class(**plain_arguments, **arguments)

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

    async def stream(
        self,
        samples: Iterable[tuple[SampleKey, dict[str, Any]]],
        max_inflight: int,
        idle_timeout: float,
        max_open: int | None = None,
        scale: Callable[[], float] | None = None,
    ) -> AsyncGenerator[TrajectoryRecord | SampleFailure | None, None]:
        """Yield each finished record as it completes, or a SampleFailure for a sample whose
        agent loop raised (after the engine-request retries) or that ran past its deadline
        (`sample_timeout`); yield None after `idle_timeout` seconds without either so the caller
        can flush what it holds.

        At most `max_inflight` model calls are in flight, later turns of started trajectories
        first (shard/call_slots.py); a new trajectory starts while a slot would otherwise go
        unused, up to `max_open` trajectories open at once (None: `max_inflight`, one slot's
        worth of trajectories each, as when a trajectory held its slot from start to finish).
        `scale`: a factor (>= 1) both limits follow, read as the stream goes (the shard's share
        of the run's in-flight budget once other shards finished: shard/progress_board.py)."""
        slots = CallSlots(max_inflight)
        if self.slotted_client is not None:
            self.slotted_client.slots = slots
        open_samples = _OpenSamples(
            iter(samples), slots, max_inflight if max_open is None else max(max_open, max_inflight)
        )
        inflight = open_samples.tasks
        self.open_samples = inflight
        open_samples.refill(self.run_one, self.sample_timeout)
        trace = SampleTrace()
        freed = asyncio.ensure_future(slots.freed.wait())
        try:
            while inflight:
                if scale is not None:
                    open_samples.follow_share(scale())
                wait = min(
                    idle_timeout, max(0.0, min(deadline for _, deadline in inflight.values()) - time.monotonic())
                )
                done, _ = await asyncio.wait(
                    [*inflight, *([] if open_samples.exhausted else [freed])],
                    timeout=wait,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if freed in done:
                    # A slot came back (a trajectory went to its tool or finished): maybe start more.
                    done.discard(freed)
                    slots.freed.clear()
                    freed = asyncio.ensure_future(slots.freed.wait())
                    open_samples.refill(self.run_one, self.sample_timeout)
                    if not done:
                        continue
                now = time.monotonic()
                expired = [task for task, (_, deadline) in inflight.items() if task not in done and deadline <= now]
                if not done and not expired:
                    yield None
                    continue
                for task in expired:
                    # Its slot is free now, whether or not the cancelled code ever stops.
                    yield self._timed_out(open_samples.close(task), task)
                for task in done:
                    yield self._outcome(open_samples.close(task), task, trace)
                open_samples.refill(self.run_one, self.sample_timeout)
        finally:
            self.open_samples = ()
            self.peak_calls_in_flight = max(self.peak_calls_in_flight, slots.peak_in_flight)
            trace.close()
            freed.cancel()
            for task in inflight:
                task.cancel()
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)
            if self.slotted_client is not None:
                self.slotted_client.slots = None

    @staticmethod
    def _outcome(key: SampleKey, task: asyncio.Task, trace: SampleTrace) -> TrajectoryRecord | SampleFailure:
        """A finished sample's record, or its failure."""
        try:
            record = task.result()
        except Exception as exc:  # noqa: BLE001 - engine, agent loop, tool or reward: this sample's failure, not the shard's
            logger.warning("sample %d:%d failed: %s: %s", key[0], key[1], type(exc).__name__, exc)
            return SampleFailure.from_exception(key, exc)
        trace.finished(record.index, record.rollout_n)
        return record

    def _timed_out(self, key: SampleKey, task: asyncio.Task) -> SampleFailure:
        """Cancel a sample past its deadline; its failure carries where it was waiting."""
        where = _where_it_waits(task)
        task.cancel()
        task.add_done_callback(_retrieve_outcome)
        _set_aside_default_executor(asyncio.get_running_loop())
        message = (
            f"sample {key[0]}:{key[1]} did not finish within generation.sample_timeout_seconds={self.sample_timeout:g} s "
            "(an agent loop, tool or reward function that does not return?) and was cancelled; raise "
            "generation.sample_timeout_seconds if its samples need longer"
        )
        logger.warning("%s", message)
        failure = SampleFailure.from_exception(key, SampleTimedOut(message))
        failure.traceback = where[-TRACEBACK_CHARS:]
        return failure

    @staticmethod
    def record_from_output(key: SampleKey, output, kwargs: dict[str, Any]) -> TrajectoryRecord:
        """The unpadded record of one AgentLoopOutput; `kwargs` are the sample's dataset fields."""
        extra_fields = dict(output.extra_fields)
        # verl's per-sample postprocessing adds the chat messages to extra_fields.
        extra_fields["raw_prompt"] = kwargs["raw_prompt"]
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
            input_fields=dict(kwargs),
            extra_fields=extra_fields,
            metrics=output.metrics.model_dump(),
        )


class _OpenSamples:
    """A stream's open samples: their tasks, and which pending sample starts when."""

    def __init__(self, pending: Iterator[tuple[SampleKey, dict[str, Any]]], slots: CallSlots, limit: int):
        self.pending = pending
        self.slots = slots
        self.limit = limit
        self.own_limits = (slots.limit, limit)
        """(model calls, open samples): the shard's own, before any share of the run's budget."""
        self.tasks: dict[asyncio.Task, tuple[SampleKey, float]] = {}
        """Each sample's task -> (its key, its deadline on the monotonic clock)."""
        self.exhausted = False
        """Every pending sample has started (a freed slot then has nothing new to start: the stream
        stops waking for it)."""

    def follow_share(self, factor: float) -> None:
        """Both limits at `factor` (>= 1) times the shard's own: its share of the run's
        in-flight budget (shard/progress_board.py)."""
        calls, samples = (round(own * max(factor, 1.0)) for own in self.own_limits)
        if calls != self.slots.limit:
            logger.debug(
                "model calls in flight: at most %d (was %d; x%.2f, the shard's share of the run's budget)",
                calls,
                self.slots.limit,
                factor,
            )
            self.slots.set_limit(calls)
            self.limit = samples

    def refill(self, run_one, sample_timeout: float) -> None:
        """Start samples while a model-call slot would otherwise go unused, up to `limit` open.
        With nothing open, one starts whatever the slots say (a cancelled sample may not have
        given its slot back yet): the stream never ends with samples left."""
        while len(self.tasks) < self.limit and (self.slots.spare > 0 or not self.tasks):
            try:
                key, kwargs = next(self.pending)
            except StopIteration:
                self.exhausted = True
                return
            self.slots.sample_started(key)
            self.tasks[asyncio.ensure_future(run_one(key, kwargs))] = (key, time.monotonic() + sample_timeout)

    def close(self, task: asyncio.Task) -> SampleKey:
        """The sample of `task` is no longer open (finished, failed or past its deadline)."""
        key, _ = self.tasks.pop(task)
        self.slots.sample_ended(key)
        return key


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
