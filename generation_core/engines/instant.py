"""An instant engine: answers every request at once with a short, deterministic completion.

A benchmark and test tool, registered like any engine (`actor_rollout_ref.rollout.name=instant`):
with no model work, a run measures what orchestration alone costs (agent loop, postprocess,
serialization, storage), and tests that only count trajectories run in seconds. The tokens are
derived from the prompt, so the same prompt always gets the same answer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from verl.workers.rollout.replica import TokenOutput

from generation_core.engines.base import SamplingParams, response_budget


@dataclass
class InstantSettings:
    prompt_length: int
    response_length: int
    eos_token_id: int
    response_tokens: int = 8
    vocab_size: int = 1000
    delay_seconds: float = 0.0
    """Seconds each request takes (tests that need requests in flight when something dies)."""


class InstantEngine:
    """The engine contract (engines/base.py) with no model behind it."""

    def __init__(self, settings: InstantSettings):
        self.settings = settings
        self.stats = {"requests": 0, "generated_tokens": 0}

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_unused: Any) -> TokenOutput:
        params = SamplingParams.from_request(sampling_params)
        if self.settings.delay_seconds:
            await asyncio.sleep(self.settings.delay_seconds)
        s = self.settings
        limit = min(response_budget(s.prompt_length, s.response_length, len(prompt_ids), params.max_tokens), s.response_tokens)
        seed = sum(prompt_ids)
        # Ids from 3 up avoid the usual special tokens (unk/bos/eos are 0-2 in Llama-style vocabularies).
        tokens = [3 + (seed + 7 * i) % (s.vocab_size - 3) for i in range(max(limit - 1, 0))]
        if limit > 0:
            tokens.append(s.eos_token_id)
        self.stats["requests"] += 1
        self.stats["generated_tokens"] += len(tokens)
        return TokenOutput(token_ids=tokens, log_probs=[-1.0] * len(tokens) if params.logprobs else None, stop_reason="completed", num_preempted=0)

    def shutdown(self) -> None:
        return None
