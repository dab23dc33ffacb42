"""An instant engine: answers every request at once with a short, deterministic completion.

A benchmark and test tool, registered like any engine (`actor_rollout_ref.rollout.name=instant`):
with no model work, a run measures what orchestration alone costs (agent loop, postprocess,
serialization, storage), and tests that only count trajectories run in seconds.

It answers as a sampling engine would, deterministically: the tokens are a function of the
prompt ids and the sampling parameters that change a real engine's draw (temperature, top_p,
top_k and the request's `seed`). Greedy requests (temperature 0 or top_k 1) depend on the prompt
alone, like a model's argmax. Sampled requests with a `seed` get their own tokens per seed, so
the n samples of one prompt differ when each carries its own seed, and the same (prompt, seed)
always gets the same answer, on the first run and on a resume. Without a seed every sampled
request for a prompt gets the same answer: verl's agent loops send no seed, and the request id
they send is random (uuid4, replaced again per turn by the replica client), so it cannot make
a resumed run equal an undisturbed one.

A response ends with EOS (`stop`) after `response_tokens` tokens, or without one (`length`)
when the response budget is smaller or the request asks for `ignore_eos`.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import struct
from dataclasses import dataclass
from typing import Any

from generation_core.config.engine_kwargs import InstantEngineKwargs
from generation_core.engines.base import STOP_EOS, STOP_LENGTH, EngineOutput, SamplingParams, response_budget


@dataclass
class InstantSettings:
    prompt_length: int
    response_length: int
    eos_token_id: int
    response_tokens: int = InstantEngineKwargs.response_tokens
    vocab_size: int = 1000
    delay_seconds: float = InstantEngineKwargs.delay_seconds
    """Seconds each request takes (tests that need requests in flight when something dies)."""


# Ids from 3 up avoid the usual special tokens (unk/bos/eos are 0-2 in Llama-style vocabularies).
FIRST_TOKEN_ID = 3


def answer_tokens(prompt_ids: list[int], params: SamplingParams, count: int, vocab_size: int) -> list[int]:
    """`count` token ids determined by the prompt and, for a sampled request, its temperature,
    top_p, top_k and seed."""
    digest = hashlib.blake2b(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids), digest_size=16)
    if not params.greedy:
        digest.update(repr((params.temperature, params.top_p, params.top_k, params.seed)).encode())
    draw = random.Random(digest.digest())
    return [FIRST_TOKEN_ID + draw.randrange(vocab_size - FIRST_TOKEN_ID) for _ in range(count)]


class InstantEngine:
    """The engine contract (engines/base.py) with no model behind it."""

    def __init__(self, settings: InstantSettings):
        self.settings = settings
        self.stats = {"requests": 0, "generated_tokens": 0}

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_unused: Any
    ) -> EngineOutput:
        params = SamplingParams.from_request(sampling_params)
        s = self.settings
        if s.delay_seconds:
            await asyncio.sleep(s.delay_seconds)
        budget = response_budget(s.prompt_length, s.response_length, len(prompt_ids), params.max_tokens)
        response_tokens = s.response_tokens
        if params.ignore_eos or budget < response_tokens:
            tokens, stop_reason = answer_tokens(prompt_ids, params, max(budget, 0), s.vocab_size), STOP_LENGTH
        else:
            # response_tokens tokens, the last one EOS (none at all for response_tokens=0).
            tokens = (
                answer_tokens(prompt_ids, params, max(response_tokens - 1, 0), s.vocab_size)
                + [s.eos_token_id][:response_tokens]
            )
            stop_reason = STOP_EOS
        self.stats["requests"] += 1
        self.stats["generated_tokens"] += len(tokens)
        return EngineOutput(
            token_ids=tokens,
            log_probs=[-1.0] * len(tokens) if params.logprobs else None,
            stop_reason=stop_reason,
            num_preempted=0,
        )

    def shutdown(self) -> None:
        return None
