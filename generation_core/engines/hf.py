"""A transformers inference engine with continuous batching, for CPU (and plain GPU) runs.

It implements the engine contract (engines/base.py): `await generate(request_id, prompt_ids=...,
sampling_params=...) -> TokenOutput`. Requests from many coroutines share one decode batch:
a finished sequence leaves the batch at once and a waiting request joins at the next step,
so the batch never waits for its longest member (a batch of 32 is ~7x faster per token than
one request at a time on a 2-core CPU). A finished sequence's KV stays in a bounded prefix cache
(prefix_cache.py): the next turn of a multi-turn trajectory prefills only its new tokens.

The decode loop runs in one background thread: torch releases the GIL inside its kernels, so
the asyncio loop that accepts requests (a Ray actor's, or the caller's) stays responsive.
No caller waits forever: a step that raises fails every request it held (in the batch or
joining it) with `EngineStepFailed`, and when the loop ends (shutdown, or a bug in the loop
itself) every request still waiting, queued ones included, fails with `EngineStopped`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, GenerationConfig
from transformers.cache_utils import Cache, DynamicLayer
from verl.workers.rollout.replica import TokenOutput

from generation_core.engines.base import STOP_EOS, STOP_LENGTH, EngineStepFailed, EngineStopped, SamplingParams, response_budget
from generation_core.engines.prefix_cache import KV, PrefixCache
from generation_core.engines.sampling import sample_next_tokens

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
    ignore_eos: bool = False
    """Every request runs to its length limit (benchmarks: fixed lengths for side-by-side rates)."""
    prefix_cache_bytes: int = 512 * 1024 * 1024
    """KV of finished sequences kept for the next turn of their trajectory (prefix_cache.py), on
    the engine's device; 0: none kept, every prompt is prefilled whole. 512 MiB is ~11k tokens
    of the bundled 135M model."""


@dataclass(eq=False)
class _Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    stop_reason: str = STOP_LENGTH


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
        # Logits of the last position only: a prefill otherwise runs the vocabulary projection
        # (a fifth of a small model's weights) over every prompt token.
        accepts = inspect.signature(self.model.forward).parameters
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}
        self.max_model_len = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.name = f"transformers engine ({path.name} on {settings.device})"
        """How errors name this engine."""
        self._incoming: queue.Queue[_Sequence] = queue.Queue()
        self._wakeup = threading.Event()
        self._stopped = False
        # Every request whose caller awaits an answer, wherever it is (queued, joining, in the
        # batch): what the end of the decode loop must fail. Callers add and remove, the loop reads.
        self._waiting: set[_Sequence] = set()
        self._waiting_lock = threading.Lock()
        self._closed = False
        self._joining: list[_Sequence] = []
        # Touched by the decode thread only.
        self._prefix_cache = PrefixCache(settings.prefix_cache_bytes) if settings.prefix_cache_bytes > 0 else None
        self.stats = {
            "forward_steps": 0, "generated_tokens": 0, "finished": 0, "busy_seconds": 0.0,
            # prefill_tokens: prompt tokens run through the model (padding and reused tokens not counted).
            "prefill_tokens": 0, "prefix_hits": 0, "prefix_misses": 0, "prefix_reused_tokens": 0,
        }
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()

    # ---- public contract --------------------------------------------------------------------

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_unused: Any) -> TokenOutput:
        params = SamplingParams.from_request(sampling_params)
        if self.settings.ignore_eos:
            params = dataclasses.replace(params, ignore_eos=True)
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        max_tokens = self._max_tokens(len(prompt_ids), params)
        if max_tokens <= 0:
            return TokenOutput(token_ids=[], log_probs=[] if params.logprobs else None, stop_reason=STOP_LENGTH)
        loop = asyncio.get_running_loop()
        generator = None
        if params.seed is not None and not params.greedy:
            # On the engine's device: sampling runs where the logits are (sample_next_tokens).
            generator = torch.Generator(device=self.settings.device).manual_seed(params.seed)
        seq = _Sequence(prompt_ids, params, max_tokens, loop, loop.create_future(), generator)
        with self._waiting_lock:
            if self._closed:
                raise EngineStopped(f"{self.name} has stopped; request {request_id} was not run")
            self._waiting.add(seq)
        try:
            self._incoming.put(seq)
            self._wakeup.set()
            await seq.future
        finally:
            with self._waiting_lock:
                self._waiting.discard(seq)
        return TokenOutput(
            token_ids=seq.token_ids,
            log_probs=seq.log_probs if params.logprobs else None,
            stop_reason=seq.stop_reason,
            num_preempted=0,
        )

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        # A step that outlives the join (a long forward) must not keep its callers waiting: they
        # hear now, and the loop ends after that step.
        self._fail_waiting("shut down")

    def _fail_waiting(self, why: str) -> None:
        """Fail every request still waiting (queued, joining or in the batch); none is accepted after."""
        with self._waiting_lock:
            self._closed = True
            waiting = list(self._waiting)
        for seq in waiting:
            _resolve(seq, EngineStopped(f"{self.name} {why} before it answered"))

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        s = self.settings
        return min(response_budget(s.prompt_length, s.response_length, prompt_len, params.max_tokens), self.max_model_len - prompt_len)

    # ---- decode loop (background thread) ---------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            # Whatever ended the loop (shutdown, or a bug in the loop itself), nobody waits on.
            self._fail_waiting("shut down" if self._stopped else "stopped (its decode loop ended)")

    def _loop(self) -> None:
        batch = _SlotBatch(self.settings.max_batch_size)
        while not self._stopped:
            if not batch.live_slots() and self._incoming.empty():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._admit(batch)
                    self._decode_step(batch)
            except Exception as exc:  # noqa: BLE001 - every caller in the step must hear of it
                # The batch and the joiners (admitted from the queue, not in the batch yet); the
                # queue waits for the next step, on a fresh batch.
                held = [batch.sequences[slot] for slot in batch.live_slots()] + self._joining
                logger.exception("%s: a step failed; failing its %d request(s)", self.name, len(held))
                for seq in held:
                    failure = EngineStepFailed(f"{self.name}: a batch step failed with {type(exc).__name__}: {exc}")
                    failure.__cause__ = exc
                    _resolve(seq, failure)
                batch = _SlotBatch(self.settings.max_batch_size)
            finally:
                self._joining = []
            self.stats["busy_seconds"] += time.perf_counter() - started

    def _admit(self, batch: "_SlotBatch") -> None:
        free = batch.free_slots()
        # Taken from the queue, in no batch yet: a failure before they join fails them too (_loop).
        joining = self._joining = []
        while len(joining) < free:
            try:
                seq = self._incoming.get_nowait()
            except queue.Empty:
                break
            if seq.future.cancelled():
                continue
            joining.append(seq)
        if not joining:
            return
        # A joiner whose prompt extends a cached sequence (its trajectory's previous turn)
        # prefills only the new tokens, on its own: each has a prefix of its own length.
        fresh = []
        for seq in joining:
            hit = self._prefix_cache.take(seq.prompt_ids) if self._prefix_cache is not None else None
            if hit is not None:
                self._prefill_after_prefix(batch, seq, *hit)
                continue
            if self._prefix_cache is not None:
                self.stats["prefix_misses"] += 1
            fresh.append(seq)
        if fresh:
            self._prefill(batch, fresh)

    def _prefill(self, batch: "_SlotBatch", joining: list[_Sequence]) -> None:
        # The joiners' prompts are prefilled together in a cache of their own; their KV then
        # moves into free slots of the running batch (a copy of the joiners only).
        width = max(len(s.prompt_ids) for s in joining)
        pad = self.eos_token_ids[0]
        ids = torch.tensor([[pad] * (width - len(s.prompt_ids)) + s.prompt_ids for s in joining])
        mask = torch.tensor([[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in joining])
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids.to(self.settings.device),
            attention_mask=mask.to(self.settings.device),
            position_ids=_positions(mask).to(self.settings.device),
            past_key_values=cache,
            use_cache=True,
            **self._last_logits_only,
        )
        self.stats["forward_steps"] += 1
        self.stats["prefill_tokens"] += sum(len(s.prompt_ids) for s in joining)
        logits = out.logits[:, -1, :].float()
        finished = self._sample(joining, logits)
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        for row, seq in enumerate(joining):
            p = len(seq.prompt_ids)
            own = [(k[row : row + 1, :, -p:], v[row : row + 1, :, -p:]) for k, v in kv]
            if row in finished:
                self._finish(seq, own)
            else:
                batch.join(seq, own)

    def _prefill_after_prefix(self, batch: "_SlotBatch", seq: _Sequence, reused: int, prefix: KV) -> None:
        """Prefill `seq`'s prompt after its first `reused` tokens, whose KV is `prefix`; then it
        joins the batch with the KV of its whole prompt, as a joiner prefilled whole does."""
        device = self.settings.device
        p = len(seq.prompt_ids)
        cache = DynamicCache(config=self.model.config)
        for layer, (k, v) in enumerate(prefix):
            cache.update(k, v, layer)
        # No padding: the mask covers the prefix and the new tokens, whose positions go on from the prefix.
        out = self.model(
            input_ids=torch.tensor([seq.prompt_ids[reused:]], device=device),
            attention_mask=torch.ones(1, p, dtype=torch.long, device=device),
            position_ids=torch.arange(reused, p, device=device).unsqueeze(0),
            past_key_values=cache,
            use_cache=True,
            **self._last_logits_only,
        )
        self.stats["forward_steps"] += 1
        self.stats["prefix_hits"] += 1
        self.stats["prefix_reused_tokens"] += reused
        self.stats["prefill_tokens"] += p - reused
        finished = self._sample([seq], out.logits[:, -1, :].float())
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        if finished:
            self._finish(seq, kv)
        else:
            batch.join(seq, kv)

    def _finish(self, seq: _Sequence, kv: KV) -> None:
        """Keep a finished sequence's KV (`kv`: its prompt and every generated token but the last,
        which was sampled, never fed) for its trajectory's next turn, then answer the caller:
        the entry is in the cache before the next turn can be sent."""
        if self._prefix_cache is not None and not seq.future.cancelled():
            tokens = seq.prompt_ids + seq.token_ids[:-1]
            assert kv[0][0].shape[2] == len(tokens), (tuple(kv[0][0].shape), len(tokens))
            self._prefix_cache.put(tokens, kv)
        _resolve(seq, None)

    def _decode_step(self, batch: "_SlotBatch") -> None:
        # Every live sequence feeds its last token (joiners got their first from the prefill).
        if not batch.live_slots():
            return
        slots = batch.live_slots()
        out = self.model(**batch.step_inputs(self.settings.device), past_key_values=batch.cache, use_cache=True, **self._last_logits_only)
        batch.advance()
        self.stats["forward_steps"] += 1
        logits = out.logits[slots, -1, :].float()
        seqs = [batch.sequences[slot] for slot in slots]
        finished = self._sample(seqs, logits)
        for row in finished:
            # Copied out before the slot is freed: the next joiner overwrites its columns.
            self._finish(seqs[row], batch.kv_of(slots[row]))
            batch.leave(slots[row])

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor) -> set[int]:
        """Sample one token for each of `seqs` (logits[n] belongs to seqs[n]), record it and
        return the positions in `seqs` of the sequences that finished (the caller `_finish`es them).

        `logits` stay on the model's device: sampling (and the log-softmax for logprobs) runs
        there, and only the chosen ids and their log-probabilities come to the host."""
        chosen = sample_next_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs])
        want_logprobs = any(s.params.logprobs for s in seqs)
        if want_logprobs:
            # Raw model log-probabilities (before temperature/top-k/top-p), like vLLM's default
            # `raw_logprobs` mode; this is what a re-score of the same tokens gives.
            picked = logits.log_softmax(dim=-1).gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        tokens = chosen.tolist()
        finished: set[int] = set()
        for n, seq in enumerate(seqs):
            token = tokens[n]
            seq.token_ids.append(token)
            if want_logprobs:
                seq.log_probs.append(picked[n])
            stop_at_eos = token in self.eos_token_ids and not seq.params.ignore_eos
            if stop_at_eos or len(seq.token_ids) >= seq.max_tokens or seq.future.cancelled():
                seq.stop_reason = STOP_EOS if stop_at_eos else STOP_LENGTH
                finished.add(n)
        self.stats["generated_tokens"] += len(seqs)
        self.stats["finished"] += len(finished)
        return finished


class _SlotBatch:
    """The running decode batch: one slot per sequence in a preallocated KV store.

    All slots share one column timeline: a decode step writes every slot's new key/value at
    column `end`, in place. A sequence that joins at column `end` with a prompt of p tokens has
    its prompt's KV copied to columns [end - p, end) of a free slot, and attends only to its own
    columns (per-slot attention mask), so the rest of the batch is never copied when somebody
    joins or leaves. The model sees the window [start, end), where `start` is the oldest live
    sequence's first column; the store is shifted left (one copy) only when it runs out of room.
    Free slots below the highest live slot ride along masked to their own current column.
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.sequences: list[_Sequence | None] = [None] * num_slots
        self.row_start = [0] * num_slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.start = 0
        self.end = 0
        self.cache = Cache(layers=[])

    # ---- membership ------------------------------------------------------------------------

    def live_slots(self) -> list[int]:
        return [slot for slot, seq in enumerate(self.sequences) if seq is not None]

    def free_slots(self) -> int:
        return sum(seq is None for seq in self.sequences)

    def join(self, seq: _Sequence, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put `seq` in the lowest free slot; `kv` is its prefilled prompt, [1, heads, width, dim]
        per layer with the prompt right-aligned (left padding)."""
        p = len(seq.prompt_ids)
        if not self.keys:
            self._allocate(kv, columns=max(2 * p, 64))
            self.start = self.end = p
        elif self.end < p:
            self._shift(p - self.end)
        slot = self.sequences.index(None)
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][slot, :, self.end - p : self.end] = k[0, :, -p:]
            self.values[layer][slot, :, self.end - p : self.end] = v[0, :, -p:]
        self.sequences[slot] = seq
        self.row_start[slot] = self.end - p
        self.start = min(self.row_start[s] for s in self.live_slots())

    def kv_of(self, slot: int) -> KV:
        """What `slot` holds, as views into the store: columns [row_start, end) of each layer."""
        lo, hi = self.row_start[slot], self.end
        return [(k[slot : slot + 1, :, lo:hi], v[slot : slot + 1, :, lo:hi]) for k, v in zip(self.keys, self.values)]

    def leave(self, slot: int) -> None:
        self.sequences[slot] = None
        live = self.live_slots()
        if not live:
            # Empty: the next joiner starts a fresh timeline (memory is kept for it).
            self.start = self.end = 0
            return
        self.start = min(self.row_start[s] for s in live)

    # ---- one decode step -------------------------------------------------------------------

    def step_inputs(self, device: str) -> dict[str, torch.Tensor]:
        """Model inputs for one decode step over slots [0, highest live slot]."""
        if self.end >= self.keys[0].shape[2]:
            self._make_room()
        rows = max(self.live_slots()) + 1
        last, starts = [], []
        for slot in range(rows):
            seq = self.sequences[slot]
            # A free slot attends only to the new column: no empty softmax, no effect on others.
            last.append(seq.token_ids[-1] if seq is not None else 0)
            starts.append(self.row_start[slot] if seq is not None else self.end)
        starts_t = torch.tensor(starts).unsqueeze(1)
        columns = torch.arange(self.start, self.end + 1).unsqueeze(0)
        self.cache.layers = [_WindowLayer(self, layer, rows) for layer in range(len(self.keys))]
        return {
            "input_ids": torch.tensor(last).unsqueeze(1).to(device),
            "attention_mask": (columns >= starts_t).long().to(device),
            "position_ids": (self.end - starts_t).to(device),
        }

    def advance(self) -> None:
        self.end += 1

    # ---- storage ---------------------------------------------------------------------------

    def _allocate(self, kv: list[tuple[torch.Tensor, torch.Tensor]], columns: int) -> None:
        self.keys = [k.new_zeros((self.num_slots, k.shape[1], columns, k.shape[3])) for k, _ in kv]
        self.values = [v.new_zeros((self.num_slots, v.shape[1], columns, v.shape[3])) for _, v in kv]

    def _make_room(self) -> None:
        """The next column is past the store: shift the window to column 0 when that frees at
        least a quarter of the store, otherwise double it."""
        capacity = self.keys[0].shape[2]
        if self.start >= capacity // 4:
            self._shift(-self.start)
        else:
            self._resize(2 * capacity, 0)

    def _shift(self, by: int) -> None:
        """Move every column by `by` (negative: left), growing the store if needed."""
        capacity = self.keys[0].shape[2]
        self._resize(max(capacity, self.end + by + 1), by)

    def _resize(self, capacity: int, shift: int) -> None:
        lo, hi = self.start, self.end
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                new = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
                new[:, :, lo + shift : hi + shift] = old[:, :, lo:hi]
                store[layer] = new
        self.row_start = [start + shift for start in self.row_start]
        self.start, self.end = lo + shift, hi + shift


class _WindowLayer(DynamicLayer):
    """One layer of the slot store as transformers sees it during a decode step: the new key and
    value are written at column `end` in place, and attention gets the window [start, end]."""

    def __init__(self, batch: _SlotBatch, layer: int, rows: int):
        super().__init__()
        self.batch, self.layer, self.rows = batch, layer, rows
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        b, layer, rows = self.batch, self.layer, self.rows
        b.keys[layer][:rows, :, b.end : b.end + 1] = key_states
        b.values[layer][:rows, :, b.end : b.end + 1] = value_states
        return b.keys[layer][:rows, :, b.start : b.end + 1], b.values[layer][:rows, :, b.start : b.end + 1]

    def get_seq_length(self) -> int:
        return self.batch.end - self.batch.start


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

    try:
        seq.loop.call_soon_threadsafe(settle)
    except RuntimeError:
        # The caller's event loop is closed: nobody waits for this answer (and the batch goes on).
        pass


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
