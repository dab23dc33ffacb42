"""The engine contract: what verl's agent loops call, and the sampling parameters they send.

verl's agent loops make one call per model turn,
`await engine.generate(request_id, prompt_ids=..., sampling_params={...}) -> TokenOutput`, with
`sampling_params` a plain dict in vLLM/SGLang's names. Every engine (the transformers engine, the
instant engine, an OpenAI-compatible server) and the routing client in front of them answer that
call. An engine turns the dict into `SamplingParams` once, where the request enters it, and sizes
the response with `response_budget`, the default verl's own servers apply, and says why it
ended in `stop_reason` with SGLang's names (verl's sglang server passes them on): `STOP_EOS` or
`STOP_LENGTH`.

Our engines answer with an `EngineOutput`, a plain dataclass with verl's TokenOutput's fields, and
the routing client (routing.py), in the shard worker, hands verl's agent loops a TokenOutput made
from it. So this module, and the engines, import no verl: an engine's replica process loads only
what its engine needs (verl's import alone is ~6 CPU-seconds: tensordict, torch._dynamo).

An engine that fails under a request raises `EngineStepFailed` (its step failed) or
`EngineStopped` (it shut down first); both name the engine, and both are transient: the
request may succeed when sent again (request_retry.is_transient).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

STOP_EOS = "stop"
"""The model ended the response: it sampled an end-of-sequence (or stop) token."""
STOP_LENGTH = "length"
"""The response reached its token budget (`response_budget`, or max_tokens when sent)."""
TURN_TIMING_KEY = "genrun_turn_timing"
"""The `extra_fields` key under which an engine may give its own account of one request:
`slot_wait` (seconds queued before it joined the batch), `prefill` (from joining to its first
token), `prefix_hit` (its prompt reused cached KV). The shard's request client takes it off
before the agent loop sees the output (serving/turn_log.py)."""


class EngineStepFailed(RuntimeError):
    """An engine's batch step raised: every request in that step fails with it, whichever one
    caused it, and a retry runs in another batch."""


class EngineStopped(ConnectionError):
    """The engine shut down (or its decode loop ended) before it answered the request; another
    replica, or this one restarted, may answer it."""


def eos_token_ids(model_path: str, tokenizer: Any = None) -> tuple[int, ...]:
    """The ids that end a response, one rule for the transformers engine, the export and the
    report's viewer (light: this module imports no verl or torch): the `eos_token_id` of the model folder's generation_config.json (an int or a
    list: Llama-3-Instruct lists its turn end `<|eot_id|>` only there), then config.json's (and
    its text_config's), then the tokenizer's when one is given (verl's SGLang and vLLM servers stop
    on it too). Read from the model's `path`, never the tokenizer folder, which may have no
    generation_config.json. In that order, each once; reads JSON only (no transformers)."""
    folder = os.path.expanduser(str(model_path))
    found: list[Any] = []
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path) as handle:
                declared = json.load(handle)
            found += [declared.get("eos_token_id"), (declared.get("text_config") or {}).get("eos_token_id")]
    found.append(None if tokenizer is None else tokenizer.eos_token_id)
    ids: list[int] = []
    for value in found:
        for token in value if isinstance(value, list) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return tuple(ids)


@dataclass
class EngineOutput:
    """One model turn's answer, with verl's TokenOutput's fields (names, defaults), so that an agent
    loop reads it as one when an engine is its client directly (library use, tests); the routing
    client (routing.py) hands the agent loops a TokenOutput made from it."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    """The sampled tokens' log-probabilities, when the request asked for them."""
    routed_experts: Any = None
    """MoE routing per token (verl's routing replay); our engines never fill it."""
    stop_reason: str | None = None
    """STOP_EOS or STOP_LENGTH (a remote server's own finish_reason as it sent it)."""
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """A token-in/token-out inference engine, as verl's replica servers expose one."""

    stats: dict[str, Any]
    """Counters since the engine started (a replica's `health()` reports them)."""

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> EngineOutput:
        """One model turn (an engine may answer with verl's TokenOutput as well). `kwargs` carry what verl adds for other engines (multimodal data,
        priority) and, from the routing client, `trajectory_key` (the same for every turn of one
        trajectory; `request_id` is fresh per turn); an engine takes what it serves and ignores the rest."""
        ...

    def shutdown(self) -> None:
        """Stop background work (threads, connections); the engine serves no more requests."""
        ...


@dataclass(frozen=True)
class SamplingParams:
    """The vLLM/SGLang sampling parameters that verl's agent loops send, parsed and checked."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1: no top-k filter."""
    logprobs: bool = False
    """Return the sampled tokens' log-probabilities."""
    max_tokens: int | None = None
    """None: the response budget alone (`response_budget`); verl never sends it."""
    seed: int | None = None
    ignore_eos: bool = False
    """Generate max_tokens whatever the model samples (vLLM/SGLang's name; benchmarks use it for fixed lengths)."""
    repetition_penalty: float = 1.0
    """1.0: none. Forwarded to remote servers; the transformers engine does not apply it."""
    stop_token_ids: tuple[int, ...] | None = None
    """Extra ids that end a response. Forwarded to remote servers."""

    @classmethod
    def from_request(cls, params: dict[str, Any]) -> SamplingParams:
        """Parse verl's sampling dict; a ValueError (the request, not the engine, is wrong) for
        values no engine accepts."""
        max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
        temperature = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1) if params.get("top_k") is not None else -1)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        seed = params.get("seed")
        repetition_penalty = params.get("repetition_penalty")
        stop_token_ids = params.get("stop_token_ids")
        return cls(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            logprobs=bool(params.get("logprobs", False)),
            max_tokens=None if max_tokens is None else int(max_tokens),
            seed=None if seed is None else int(seed),
            ignore_eos=bool(params.get("ignore_eos", False)),
            repetition_penalty=1.0 if repetition_penalty is None else float(repetition_penalty),
            stop_token_ids=None if stop_token_ids is None else tuple(int(t) for t in stop_token_ids),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def response_budget(prompt_length: int, response_length: int, prompt_len: int, asked: int | None) -> int:
    """Tokens a request may generate. verl never sends max_tokens; its servers apply this same
    default (the rest of prompt_length + response_length, at most response_length), and a
    max_tokens that is sent can only lower it."""
    limit = min(response_length, prompt_length + response_length - prompt_len)
    return limit if asked is None else min(limit, int(asked))


def prefix_hit_rate(stats: dict[str, Any]) -> float | None:
    """Prompt tokens reused from a prefix cache / prompt tokens, from an engine's counters (this
    engine's, or the transformers engine's, which counts a shared prefix apart); None when none."""
    reused = int(stats.get("prefix_reused_tokens", 0)) + int(stats.get("shared_prefix_tokens", 0))
    total = reused + int(stats.get("prefill_tokens", 0))
    return reused / total if total else None
