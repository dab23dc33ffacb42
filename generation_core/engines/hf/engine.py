"""A transformers inference engine with continuous batching, for CPU (and plain GPU) runs.

It implements the engine contract (engines/base.py): `await generate(request_id, prompt_ids=...,
sampling_params=...) -> EngineOutput`. Requests from many coroutines share one decode batch:
a finished sequence leaves the batch at once and a waiting request joins at the next step,
so the batch never waits for its longest member (a batch of 32 is ~7x faster per token than
one request at a time on a 2-core CPU). Joiners are prefilled inside the batch's decode pass
(packed_step.py). A finished sequence's KV, and the KV of prompts prefilled whole, stay in a
bounded prefix cache (prefix_cache.py): the next turn of a multi-turn trajectory prefills only
its new tokens, and a prompt reuses the system prompt and chat header it shares with earlier ones.
Waiting requests join in arrival order, except that a trajectory's later turns go first (admission.py).

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
from typing import Any, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import CacheLayerMixin

from generation_core.config.engine_kwargs import HF_PREFIX_CACHE_BYTES, HfEngineKwargs
from generation_core.engines.base import (
    STOP_EOS,
    STOP_LENGTH,
    TURN_TIMING_KEY,
    EngineOutput,
    EngineStepFailed,
    EngineStopped,
    SamplingParams,
    eos_token_ids,
    response_budget,
)
from generation_core.engines.hf import packed_step
from generation_core.engines.hf.admission import AdmissionQueue, RequestIds
from generation_core.engines.hf.cpu_linear import use_weight_first_linears
from generation_core.engines.hf.packed_step import PackedStep
from generation_core.engines.hf.prefix_cache import KV, PrefixCache, PrefixHit
from generation_core.engines.hf.sampling import sample_next_tokens
from generation_core.engines.hf.slot_batch import KVShape, SlotBatch
from generation_core.engines.server import cpu_threads_per_replica

logger = logging.getLogger(__name__)


@dataclass
class EngineSettings:
    """What the engine needs from the run config, nothing more."""

    model_path: str
    prompt_length: int
    response_length: int
    max_batch_size: int = 32
    num_threads: int | None = HfEngineKwargs.num_threads
    dtype: str = "float32"
    device: str = "cpu"
    trust_remote_code: bool = False
    ignore_eos: bool = HfEngineKwargs.ignore_eos
    """Every request runs to its length limit (benchmarks: fixed lengths for side-by-side rates)."""
    prefix_cache_bytes: int = HF_PREFIX_CACHE_BYTES
    """KV of finished sequences (for the next turn of their trajectory) and of prompts (for the
    prefixes later prompts share with them) kept on the engine's device (prefix_cache.py); 0:
    none kept, every prompt is prefilled whole."""
    mixed_steps: bool = True
    """Joiners' prompts are prefilled in the same forward pass as the running batch's decode
    tokens (packed_step.py), when the model's attention allows it (checked at start)."""
    max_step_tokens: int = 8192
    """Most tokens one mixed step runs (decode tokens + joiners' new prompt tokens): joiners beyond
    it wait for the next step (rollout.max_num_batched_tokens). A prompt is never split: one
    longer than this still joins, alone."""
    later_turns_first: bool = HfEngineKwargs.later_turns_first
    """A trajectory's next turn (same trajectory key: the agent loop's id) joins the batch before
    queued first turns (admission.py); false: arrival order."""
    weight_first_linear: bool = HfEngineKwargs.weight_first_linear
    """On a CPU, linear layers of 2-128 rows compute `W @ x^T` (cpu_linear.py), which MKL runs up
    to 1.9x faster than `x @ W^T` with few rows; false: transformers' `nn.Linear` as it is."""


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
    later_turn: bool = False
    """It continues a trajectory this engine served before (admission.py)."""
    queued: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    """When it left the queue to join the batch (perf_counter)."""
    first_token: float | None = None
    prefix_hit: bool = False
    """Its prompt reused cached KV (its trajectory's previous turn, or a shared prefix)."""

    def timing(self) -> dict[str, Any]:
        """The request's own account (engines/base.TURN_TIMING_KEY)."""
        admitted = self.queued if self.admitted is None else self.admitted
        first = admitted if self.first_token is None else self.first_token
        return {
            "slot_wait": round(admitted - self.queued, 6),
            "prefill": round(first - admitted, 6),
            "prefix_hit": self.prefix_hit,
        }


def _new_stats() -> dict[str, Any]:
    """The engine's counters, all zero (`genrun status`, the report and the bench read them)."""
    return {
        "forward_steps": 0,
        "generated_tokens": 0,
        "finished": 0,
        "busy_seconds": 0.0,
        # prefill_tokens: prompt tokens run through the model (padding and reused tokens not counted).
        # prefix_hits: prompts that extend their trajectory's previous turn (its KV reused);
        # shared_prefix_hits: prompts that reuse a prefix they share with another (a system
        # prompt, another sample of the same prompt); prefix_misses: all but prefix_hits.
        "prefill_tokens": 0,
        "prefix_hits": 0,
        "prefix_misses": 0,
        "prefix_reused_tokens": 0,
        "shared_prefix_hits": 0,
        "shared_prefix_tokens": 0,
        # Mixed steps: passes that decoded the batch and prefilled joiners at once; the most
        # tokens one pass ran.
        "mixed_steps": 0,
        "largest_step_tokens": 0,
        # Requests that continued a trajectory and went ahead of queued first turns.
        "later_turns": 0,
        # Sequences moved down into slots that others left (SlotBatch.compact).
        "slot_moves": 0,
    }


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
        ).to(settings.device)  # type: ignore[arg-type]  # transformers types `to` as @wraps(nn.Module.to), whose first parameter is self
        self.model.eval()
        if settings.weight_first_linear:
            # CPU layers only (the function skips the others); before the mixed-step check
            # below, which then covers them too.
            use_weight_first_linears(self.model)
        self.config = AutoConfig.from_pretrained(str(path), trust_remote_code=settings.trust_remote_code)
        self.eos_token_ids = _eos_token_ids(path)
        # Logits of the last position only: a prefill otherwise runs the vocabulary projection
        # (a fifth of a small model's weights) over every prompt token.
        accepts = inspect.signature(self.model.forward).parameters
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}
        self.max_model_len = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.name = f"transformers engine ({path.name} on {settings.device})"
        """How errors name this engine."""
        self._kv_shape = KVShape.of(self.config, self.model.dtype, settings.device)
        self._mixed = settings.mixed_steps and self._mixed_steps_work()
        self._incoming = AdmissionQueue()
        self._request_ids = RequestIds()
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
        self.stats = _new_stats()
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()

    # ---- public contract --------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        trajectory_key: str | None = None,
        **_unused: Any,
    ) -> EngineOutput:
        """`trajectory_key`: the same for every turn of one trajectory (the routing client sends
        the agent loop's id; `request_id` is fresh per turn there); without it, `request_id`."""
        params = SamplingParams.from_request(sampling_params)
        if self.settings.ignore_eos:
            params = dataclasses.replace(params, ignore_eos=True)
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        max_tokens = self._max_tokens(len(prompt_ids), params)
        if max_tokens <= 0:
            return EngineOutput(token_ids=[], log_probs=[] if params.logprobs else None, stop_reason=STOP_LENGTH)
        loop = asyncio.get_running_loop()
        generator = None
        if params.seed is not None and not params.greedy:
            # On the engine's device: sampling runs where the logits are (sample_next_tokens).
            generator = torch.Generator(device=self.settings.device).manual_seed(params.seed)
        seq = _Sequence(prompt_ids, params, max_tokens, loop, loop.create_future(), generator)
        if self.settings.later_turns_first and self._request_ids.seen_before(trajectory_key or request_id):
            seq.later_turn = True
            self.stats["later_turns"] += 1
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
        return EngineOutput(
            token_ids=seq.token_ids,
            log_probs=seq.log_probs if params.logprobs else None,
            stop_reason=seq.stop_reason,
            num_preempted=0,
            extra_fields={TURN_TIMING_KEY: seq.timing()},
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
        return min(
            response_budget(s.prompt_length, s.response_length, prompt_len, params.max_tokens),
            self.max_model_len - prompt_len,
        )

    # ---- decode loop (background thread) ---------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            # Whatever ended the loop (shutdown, or a bug in the loop itself), nobody waits on.
            self._fail_waiting("shut down" if self._stopped else "stopped (its decode loop ended)")

    def _loop(self) -> None:
        batch = SlotBatch(self.settings.max_batch_size)
        while not self._stopped:
            if not batch.live_slots() and self._incoming.empty():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._step(batch)
            except Exception as exc:  # noqa: BLE001 - every caller in the step must hear of it
                # The batch and the joiners (admitted from the queue, not in the batch yet); the
                # queue waits for the next step, on a fresh batch.
                held = [batch.sequences[slot] for slot in batch.live_slots()] + self._joining
                logger.exception("%s: a step failed; failing its %d request(s)", self.name, len(held))
                for seq in held:
                    failure = EngineStepFailed(f"{self.name}: a batch step failed with {type(exc).__name__}: {exc}")
                    failure.__cause__ = exc
                    _resolve(seq, failure)
                batch = SlotBatch(self.settings.max_batch_size)
            finally:
                self._joining = []
            self.stats["busy_seconds"] += time.perf_counter() - started

    def _step(self, batch: SlotBatch) -> None:
        """One turn of the decode loop: joiners in, one token for every sequence in the batch."""
        self.stats["slot_moves"] += batch.compact()
        if self._mixed:
            self._mixed_step(batch)
        else:
            self._admit(batch)
            self._decode_step(batch)

    def _mixed_steps_work(self) -> bool:
        """Switch the model to the packed attention and check, on a scratch batch, that mixed
        steps give the logits plain forwards give (two joiners, then a decode step with a third
        joining); otherwise stay with plain steps."""
        previous = self.model.config._attn_implementation
        try:
            packed_step.register()
            self.model.set_attn_implementation(packed_step.PACKED_ATTENTION)
            with torch.inference_mode():
                if packed_step.agrees_with_plain_forwards(
                    self.model, self._kv_shape, self.settings.device, bool(self._last_logits_only)
                ):
                    return True
            logger.warning(
                "%s: mixed prefill+decode steps disagree with plain forwards for this model; using plain steps",
                self.name,
            )
        except Exception as exc:  # noqa: BLE001 - any model the packed attention cannot drive runs plain steps
            logger.warning(
                "%s: mixed prefill+decode steps unavailable for this model (%s: %s); using plain steps",
                self.name,
                type(exc).__name__,
                exc,
            )
        self.model.set_attn_implementation(previous)
        return False

    def _mixed_step(self, batch: SlotBatch) -> None:
        """Admit joiners (up to the free slots and max_step_tokens), then one forward pass that
        decodes every live slot and prefills every joiner's prompt (after its reused prefix)."""
        decoding = batch.live_slots()
        budget = self.settings.max_step_tokens - len(decoding)
        joiners: list[tuple[_Sequence, int, KV | None]] = []
        joining = self._joining = []
        while len(joining) < batch.free_slots():
            seq = self._incoming.peek()
            if seq is None:
                break
            prompt_len = len(seq.prompt_ids)
            if joining and prompt_len > budget:
                break  # waits for the next step (counted whole: a prefix it may reuse is not looked up yet)
            if joining and self._shares_with_a_fresh_joiner(seq, joiners):
                # Its prefix (a system prompt, the same prompt for another sample) is being
                # prefilled in this step: next step it reuses that KV instead of computing it again.
                break
            self._incoming.take(seq)
            if seq.future.cancelled():
                continue
            joining.append(seq)
            hit = self._look_up_prefix(seq)
            reused, prefix = (hit.reused, hit.kv) if hit is not None else (0, None)
            joiners.append((seq, reused, prefix))
            budget -= prompt_len - reused
        if not decoding and not joiners:
            return
        device = self.settings.device
        if joiners:
            joiner_slots = batch.place(joiners, self._kv_shape)
        else:
            joiner_slots = []
            batch.make_room(1, self._kv_shape)
        packed = PackedStep.build(
            batch,
            decoding,
            [(slot, seq.prompt_ids, reused) for slot, (seq, reused, _) in zip(joiner_slots, joiners, strict=True)],
            device,
        )
        self.stats["prefill_tokens"] += sum(len(seq.prompt_ids) - reused for seq, reused, _ in joiners)
        logits = packed_step.forward(self.model, packed, device, bool(self._last_logits_only))
        batch.advance()
        if self._prefix_cache is not None:
            for slot, (seq, reused, _) in zip(joiner_slots, joiners, strict=True):
                if not reused:
                    # Read by later prompts that start the same way; never taken.
                    self._prefix_cache.put(seq.prompt_ids, batch.kv_of(slot), shared=True)
        self.stats["forward_steps"] += 1
        self.stats["mixed_steps"] += bool(decoding and joiners)
        self.stats["largest_step_tokens"] = max(self.stats["largest_step_tokens"], len(packed.ids))
        slots = decoding + joiner_slots
        seqs = [batch.sequences[slot] for slot in slots]
        for row in self._sample(seqs, logits):
            # Copied out before the slot is freed: the next joiner overwrites its columns.
            self._finish(seqs[row], batch.kv_of(slots[row]))
            batch.leave(slots[row])

    def _look_up_prefix(self, seq: _Sequence) -> PrefixHit | None:
        # Every joiner passes here as it leaves the queue.
        seq.admitted = time.perf_counter()
        if self._prefix_cache is None:
            return None
        hit = self._prefix_cache.take(seq.prompt_ids)
        seq.prefix_hit = hit is not None
        if hit is not None and hit.own:
            self.stats["prefix_hits"] += 1
            self.stats["prefix_reused_tokens"] += hit.reused
            return hit
        self.stats["prefix_misses"] += 1
        if hit is not None:
            self.stats["shared_prefix_hits"] += 1
            self.stats["shared_prefix_tokens"] += hit.reused
        return hit

    def _shares_with_a_fresh_joiner(self, seq: _Sequence, joiners: list[tuple[_Sequence, int, KV | None]]) -> bool:
        """Whether `seq` starts like a prompt that joins in this step with nothing reused (its KV
        goes into the prefix cache after the step)."""
        if self._prefix_cache is None:
            return False
        least = self._prefix_cache.min_shared_tokens
        head = seq.prompt_ids[:least]
        return len(head) == least and any(
            not reused and other.prompt_ids[:least] == head for other, reused, _ in joiners
        )

    def _admit(self, batch: SlotBatch) -> None:
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
            hit = self._look_up_prefix(seq)
            if hit is not None:
                self._prefill_after_prefix(batch, seq, hit.reused, hit.kv)
                continue
            fresh.append(seq)
        if fresh:
            self._prefill(batch, fresh)

    def _prefill(self, batch: SlotBatch, joining: list[_Sequence]) -> None:
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
        kv = _cache_kv(cache)
        for row, seq in enumerate(joining):
            p = len(seq.prompt_ids)
            own = [(k[row : row + 1, :, -p:], v[row : row + 1, :, -p:]) for k, v in kv]
            if row in finished:
                self._finish(seq, own)
            else:
                batch.join(seq, own)

    def _prefill_after_prefix(self, batch: SlotBatch, seq: _Sequence, reused: int, prefix: KV) -> None:
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
        self.stats["prefill_tokens"] += p - reused
        finished = self._sample([seq], out.logits[:, -1, :].float())
        kv = _cache_kv(cache)
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

    def _decode_step(self, batch: SlotBatch) -> None:
        # Every live sequence feeds its last token (joiners got their first from the prefill).
        if not batch.live_slots():
            return
        slots = batch.live_slots()
        out = self.model(
            **batch.step_inputs(self.settings.device),
            past_key_values=batch.cache,
            use_cache=True,
            **self._last_logits_only,
        )
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
            if len(seq.token_ids) == 1:
                seq.first_token = time.perf_counter()
            if want_logprobs:
                seq.log_probs.append(picked[n])
            stop_at_eos = token in self.eos_token_ids and not seq.params.ignore_eos
            if stop_at_eos or len(seq.token_ids) >= seq.max_tokens or seq.future.cancelled():
                seq.stop_reason = STOP_EOS if stop_at_eos else STOP_LENGTH
                finished.add(n)
        self.stats["generated_tokens"] += len(seqs)
        self.stats["finished"] += len(finished)
        return finished


def engine_on_this_node(settings: EngineSettings, replicas_on_node: int) -> Any:
    """The engine as its replica's server actor builds it (replicas.HFReplica): unless the
    settings name a thread count, it takes its share of the CPUs of the node it runs on, which
    need not be the driver's. A vision-language model gets the plainer engine of vl.py."""
    settings = dataclasses.replace(
        settings, num_threads=settings.num_threads or cpu_threads_per_replica(replicas_on_node)
    )
    from generation_core.engines.hf.vl import VisionLanguageEngine, is_vision_language

    if is_vision_language(settings):
        return VisionLanguageEngine(settings, _eos_token_ids(Path(settings.model_path)))
    return HFEngine(settings)


def _cache_kv(cache: DynamicCache) -> KV:
    """Each layer's keys and values after a forward filled them: full-attention layers (the
    cache's types also admit linear-attention layers and unfilled ones, which these models have not)."""
    return [
        (cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values))
        for layer in cast(list[CacheLayerMixin], cache.layers)
    ]


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


def _eos_token_ids(path: Path) -> list[int]:
    ids = list(eos_token_ids(str(path)))
    if not ids:
        raise ValueError(f"{path}: neither generation_config.json nor config.json names an eos_token_id")
    return ids
