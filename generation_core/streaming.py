"""Streaming agent-loop worker: verl's AgentLoopWorker, one trajectory handed on as it finishes.

verl's `generate_sequences` gathers a whole batch before returning; a generation pipeline must
not wait for its slowest sample. This worker runs verl's own per-sample path
(`_run_agent_loop`, which includes verl's single-item postprocessing) with at most
`max_inflight` samples outstanding, and yields each result the moment it completes. The padded
output is stripped back to an unpadded record: padding is re-applied once, at merge.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from omegaconf import DictConfig
from verl.experimental.agent_loop import AgentLoopWorker
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

from generation_core.errors import GenrunError
from generation_core.records import TrajectoryRecord

logger = logging.getLogger(__name__)

# A local file that gets one line per finished trajectory, flushed at once (debugging aid: it
# shows what a killed run had finished but not yet committed).
SAMPLE_TRACE_ENV = "GENRUN_SAMPLE_TRACE"

SampleKey = tuple[int, int]


class StreamingWorker:
    def __init__(self, cfg: DictConfig, llm_client):
        self.worker = AgentLoopWorker(cfg, llm_client)
        rollout = cfg.actor_rollout_ref.rollout
        # The same sampling parameters verl's generate_sequences sends for a training step.
        self.sampling_params = dict(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            repetition_penalty=1.0,
            logprobs=rollout.calculate_log_probs,
        )
        self.prompt_length = rollout.prompt_length

    @property
    def tokenizer(self):
        return self.worker.tokenizer

    def check_agent_names(self, names: Iterable[str]) -> None:
        unknown = sorted(set(names) - set(_agent_loop_registry))
        if unknown:
            raise GenrunError(f"unknown agent loop {unknown[0]!r}; registered agent loops: {', '.join(sorted(_agent_loop_registry))}")

    async def run_one(self, key: SampleKey, kwargs: dict[str, Any]) -> TrajectoryRecord:
        index, rollout_n = key
        trajectory = {"step": -1, "sample_index": index, "rollout_n": rollout_n, "validate": False}
        output = await self.worker._run_agent_loop(dict(self.sampling_params), trajectory, trace=False, **kwargs)
        return self._to_record(key, output, kwargs)

    async def stream(
        self, samples: Iterable[tuple[SampleKey, dict[str, Any]]], max_inflight: int, idle_timeout: float
    ) -> AsyncIterator[TrajectoryRecord | None]:
        """Yield each finished record as it completes; yield None after `idle_timeout` seconds
        without a completion so the caller can flush what it holds."""
        pending_samples = iter(samples)
        inflight: set[asyncio.Task] = set()

        def refill() -> None:
            while len(inflight) < max_inflight:
                try:
                    key, kwargs = next(pending_samples)
                except StopIteration:
                    return
                inflight.add(asyncio.ensure_future(self.run_one(key, kwargs)))

        refill()
        trace_path = os.environ.get(SAMPLE_TRACE_ENV)
        trace = open(trace_path, "a", buffering=1) if trace_path else None
        try:
            while inflight:
                done, _ = await asyncio.wait(inflight, timeout=idle_timeout, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    yield None
                    continue
                for task in done:
                    inflight.discard(task)
                    record = task.result()
                    if trace is not None:
                        trace.write(f"{time.time():.3f} finished {record.index}:{record.rollout_n}\n")
                    yield record
                refill()
        finally:
            if trace is not None:
                trace.close()
            for task in inflight:
                task.cancel()
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)

    def _to_record(self, key: SampleKey, output, kwargs: dict[str, Any]) -> TrajectoryRecord:
        prompt_width = output.prompt_ids.shape[1]
        prompt_real = output.attention_mask[0, :prompt_width].bool()
        response_len = int(output.attention_mask[0, prompt_width:].sum())
        logprobs = None
        if output.response_logprobs is not None:
            logprobs = output.response_logprobs[0, :response_len].tolist()
        return TrajectoryRecord(
            index=key[0],
            rollout_n=key[1],
            prompt_ids=output.prompt_ids[0][prompt_real].tolist(),
            response_ids=output.response_ids[0, :response_len].tolist(),
            response_mask=output.response_mask[0, :response_len].tolist(),
            response_logprobs=logprobs,
            reward_score=None if output.reward_score is None else float(output.reward_score),
            num_turns=int(output.num_turns),
            input_fields=dict(kwargs),
            extra_fields=dict(output.extra_fields),
            metrics=output.metrics.model_dump(),
        )
