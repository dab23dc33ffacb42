"""A transformers inference engine with continuous batching, for CPU (and plain GPU) runs.

It serves verl's token-in/token-out contract: `await generate(request_id, prompt_ids=...,
sampling_params=...) -> TokenOutput`. Requests from many coroutines share one decode batch:
a finished sequence leaves the batch at once and a waiting request joins at the next step,
so the batch never waits for its longest member (a batch of 32 is ~7x faster per token than
one request at a time on a 2-core CPU).

The decode loop runs in one background thread: torch releases the GIL inside its kernels, so
the asyncio loop that accepts requests (a Ray actor's, or the caller's) stays responsive.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, GenerationConfig
from verl.workers.rollout.replica import TokenOutput

from generation_core.engines.sampling import SamplingParams, sample_next_tokens

logger = logging.getLogger(__name__)


@dataclass
class EngineSettings:
    """What the engine needs from the run config, nothing more."""

    model_path: str
    prompt_length: int
    response_length: int
    max_batch_size: int = 32
    num_threads: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    trust_remote_code: bool = False


@dataclass
class _Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)


class HFEngine:
    """Continuous-batching generation over a transformers causal LM."""

    def __init__(self, settings: EngineSettings):
        self.settings = settings
        if settings.num_threads:
            # Ray sets OMP_NUM_THREADS to an actor's CPU count (often 1); the engine owns the cores.
            torch.set_num_threads(settings.num_threads)
        path = Path(settings.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, settings.dtype), trust_remote_code=settings.trust_remote_code
        ).to(settings.device)
        self.model.eval()
        self.config = AutoConfig.from_pretrained(str(path), trust_remote_code=settings.trust_remote_code)
        self.eos_token_ids = _eos_token_ids(path, self.config)
        self.max_model_len = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self._incoming: queue.Queue[_Sequence] = queue.Queue()
        self._wakeup = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()
        self.stats = {"forward_steps": 0, "generated_tokens": 0, "finished": 0, "busy_seconds": 0.0}

    # ---- public contract --------------------------------------------------------------------

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **_unused) -> TokenOutput:
        params = SamplingParams.from_request(sampling_params)
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        max_tokens = self._max_tokens(len(prompt_ids), params)
        if max_tokens <= 0:
            return TokenOutput(token_ids=[], log_probs=[] if params.logprobs else None, stop_reason="completed")
        loop = asyncio.get_running_loop()
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator().manual_seed(int(params.seed))
        seq = _Sequence(prompt_ids, params, max_tokens, loop, loop.create_future(), generator)
        self._incoming.put(seq)
        self._wakeup.set()
        await seq.future
        return TokenOutput(
            token_ids=seq.token_ids,
            log_probs=seq.log_probs if params.logprobs else None,
            stop_reason="completed",
            num_preempted=0,
        )

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        # verl never sends max_tokens; its servers apply this same default.
        s = self.settings
        limit = min(s.response_length, s.prompt_length + s.response_length - prompt_len)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens)
        return min(limit, self.max_model_len - prompt_len)

    # ---- decode loop (background thread) ---------------------------------------------------

    def _run(self) -> None:
        batch = _Batch()
        while not self._stopped:
            if not batch.sequences and self._incoming.empty():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._admit(batch)
                    self._decode_step(batch)
            except Exception as exc:  # noqa: BLE001 - every waiting caller must hear of it
                logger.exception("engine step failed; failing %d requests", len(batch.sequences))
                for seq in batch.sequences:
                    _resolve(seq, exc)
                batch = _Batch()
            self.stats["busy_seconds"] += time.perf_counter() - started

    def _admit(self, batch: "_Batch") -> None:
        free = self.settings.max_batch_size - len(batch.sequences)
        joining: list[_Sequence] = []
        while free > 0:
            try:
                seq = self._incoming.get_nowait()
            except queue.Empty:
                break
            if seq.future.cancelled():
                continue
            joining.append(seq)
            free -= 1
        if not joining:
            return
        width = max(len(s.prompt_ids) for s in joining)
        pad = self.eos_token_ids[0]
        ids = torch.tensor([[pad] * (width - len(s.prompt_ids)) + s.prompt_ids for s in joining])
        mask = torch.tensor([[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in joining])
        cache = DynamicCache(config=self.model.config)
        try:
            out = self.model(
                input_ids=ids.to(self.settings.device),
                attention_mask=mask.to(self.settings.device),
                position_ids=_positions(mask).to(self.settings.device),
                past_key_values=cache,
                use_cache=True,
            )
        except Exception as exc:  # noqa: BLE001 - not yet in the batch: their callers must hear of it here
            for seq in joining:
                _resolve(seq, exc)
            raise
        self.stats["forward_steps"] += 1
        new_kv = [(layer.keys, layer.values) for layer in cache.layers]
        batch.join(joining, new_kv, mask)
        self._emit(batch, out.logits[:, -1, :].float().cpu(), rows=range(len(batch.sequences) - len(joining), len(batch.sequences)))

    def _decode_step(self, batch: "_Batch") -> None:
        # Rows that just joined already received their first token from the prefill logits;
        # every row now feeds its last token.
        if not batch.sequences:
            return
        last = torch.tensor([[s.token_ids[-1]] for s in batch.sequences])
        batch.mask = torch.cat([batch.mask, torch.ones(len(batch.sequences), 1, dtype=batch.mask.dtype)], dim=1)
        cache = DynamicCache(ddp_cache_data=batch.kv)
        out = self.model(
            input_ids=last.to(self.settings.device),
            attention_mask=batch.mask.to(self.settings.device),
            position_ids=(batch.mask.sum(dim=1, keepdim=True) - 1).to(self.settings.device),
            past_key_values=cache,
            use_cache=True,
        )
        self.stats["forward_steps"] += 1
        batch.kv = [(layer.keys, layer.values) for layer in cache.layers]
        self._emit(batch, out.logits[:, -1, :].float().cpu(), rows=range(len(batch.sequences)))

    def _emit(self, batch: "_Batch", logits: torch.Tensor, rows: range) -> None:
        """Sample one token for each of `rows` (logits[n] belongs to rows[n]), record it, and
        retire every sequence that finished."""
        rows = list(rows)
        seqs = [batch.sequences[i] for i in rows]
        chosen = sample_next_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs])
        want_logprobs = any(s.params.logprobs for s in seqs)
        if want_logprobs:
            # Raw model log-probabilities (before temperature/top-k/top-p), like vLLM's default
            # `raw_logprobs` mode; this is what a re-score of the same tokens gives.
            picked = logits.log_softmax(dim=-1).gather(1, chosen.unsqueeze(1)).squeeze(1)
        finished: list[int] = []
        for n, (row, seq) in enumerate(zip(rows, seqs)):
            token = int(chosen[n])
            seq.token_ids.append(token)
            if want_logprobs:
                seq.log_probs.append(float(picked[n]))
            stop_at_eos = token in self.eos_token_ids and not seq.params.ignore_eos
            if stop_at_eos or len(seq.token_ids) >= seq.max_tokens or seq.future.cancelled():
                finished.append(row)
        self.stats["generated_tokens"] += len(rows)
        if finished:
            for row in finished:
                _resolve(batch.sequences[row], None)
            self.stats["finished"] += len(finished)
            batch.drop(finished)


class _Batch:
    """The running decode batch: sequences, their left-padded attention mask and KV cache."""

    def __init__(self):
        self.sequences: list[_Sequence] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def join(self, joining: list[_Sequence], kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        if not self.sequences:
            self.sequences, self.kv, self.mask = list(joining), kv, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        old_kv = [(_pad_left(k, width), _pad_left(v, width)) for k, v in self.kv]
        new_kv = [(_pad_left(k, width), _pad_left(v, width)) for k, v in kv]
        self.kv = [(torch.cat([ok, nk]), torch.cat([ov, nv])) for (ok, ov), (nk, nv) in zip(old_kv, new_kv)]
        self.mask = torch.cat([_pad_left(self.mask, width, dim=1), _pad_left(mask, width, dim=1)])
        self.sequences.extend(joining)

    def drop(self, rows: list[int]) -> None:
        keep = [i for i in range(len(self.sequences)) if i not in set(rows)]
        self.sequences = [self.sequences[i] for i in keep]
        if not keep:
            self.mask = torch.zeros(0, 0, dtype=torch.long)
            self.kv = []
            return
        index = torch.tensor(keep)
        self.mask = self.mask[index]
        # Columns that are padding for every remaining row cost compute on each step: cut them.
        first_used = int((self.mask.sum(dim=0) > 0).nonzero()[0])
        self.mask = self.mask[:, first_used:]
        self.kv = [(k[index, :, first_used:], v[index, :, first_used:]) for k, v in self.kv]


def _pad_left(t: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


def _resolve(seq: _Sequence, error: BaseException | None) -> None:
    def settle() -> None:
        if seq.future.done():
            return
        if error is None:
            seq.future.set_result(None)
        else:
            seq.future.set_exception(error)

    seq.loop.call_soon_threadsafe(settle)


def _eos_token_ids(path: Path, config) -> list[int]:
    ids: list[int] = []
    try:
        generation_config = GenerationConfig.from_pretrained(str(path))
        eos = generation_config.eos_token_id
    except OSError:
        eos = None
    for value in (eos, getattr(config, "eos_token_id", None)):
        if value is None:
            continue
        for token in value if isinstance(value, list) else [value]:
            if int(token) not in ids:
                ids.append(int(token))
    if not ids:
        raise ValueError(f"{path}: neither generation_config.json nor config.json names an eos_token_id")
    return ids
