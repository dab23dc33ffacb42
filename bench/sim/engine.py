"""A simulated engine for scheduling work: a continuous-batching engine with no model, whose time
is simulated (`actor_rollout_ref.rollout.name=simulated` once bench/sim's `register()` ran).

What decides how busy a GPU replica is, and nothing else: `max_num_seqs` slots (the rest queue in
arrival order), one decode step of the whole batch every `decode_seconds_per_step`, a prefill cost
per prompt token missing from the prefix cache (whole blocks, bounded, LRU), and seeded lognormal
response lengths (from the engine seed, the prompt and a request's `seed`: a resumed run equals an
uninterrupted one) of the instant engine's tokens. `time_scale` is wall seconds per simulated
second; under `VirtualClockLoop` every wait is a jump of the loop's clock instead. At time_scale 1,
without prefill cost or length spread, it stands in for a GPU engine (bench/sim/gpu_rate.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import selectors
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from generation_core.engines.base import (
    STOP_EOS,
    STOP_LENGTH,
    EngineOutput,
    EngineStopped,
    SamplingParams,
    response_budget,
)
from generation_core.engines.instant import answer_tokens


@dataclass
class SimulatedSettings:
    """The first five come from the rollout config; the rest are `engine_kwargs.simulated`'s keys
    (bench/sim/replica.py), each default written here once."""

    prompt_length: int
    response_length: int
    eos_token_id: int
    max_num_seqs: int = 64
    vocab_size: int = 1000
    decode_seconds_per_step: float = 0.02
    """Simulated seconds of one decode step: every running sequence gets one token."""
    prefill_seconds_per_token: float = 0.0001
    """Simulated seconds per prompt token prefilled (a prefix-cache hit costs nothing)."""
    prefix_cache_tokens: int = 65536
    """Tokens the prefix cache holds (LRU by block); 0: no cache."""
    cache_block_tokens: int = 16
    """Tokens per cache block: a prefix is reused in whole blocks, as vLLM's and SGLang's are."""
    response_tokens_median: int = 64
    response_tokens_sigma: float = 0.0
    """Response lengths: lognormal around the median (0: every response the median)."""
    response_tokens_prompt_share: float = 0.0
    """The share of the lengths' log-variance that the prompt decides, the same on every replica
    and every run (a hard prompt gets long answers); the rest is each request's own draw. 0: no
    two samples of a prompt are alike; 1: the prompt decides the length."""
    seed: int = 0
    time_scale: float = 1.0
    """Wall seconds per simulated second (0.01: a hundred times faster than simulated)."""


COUNTERS = (
    "requests generated_tokens running waiting steps prefill_tokens prefix_hits prefix_misses prefix_reused_tokens"
)
SECONDS = "busy_slot_seconds simulated_seconds late_seconds"
"""`stats`: `running` and `waiting` now; `busy_slot_seconds` (running sequences x simulated seconds);
`late_seconds`, what the engine lost to steps that started late because its own process was busy."""

ROLLOUT_FIELDS = ("prompt_length", "response_length", "eos_token_id", "max_num_seqs", "vocab_size")
"""SimulatedSettings' fields that come from the rollout config and the model, not engine_kwargs."""


class BlockPrefixCache:
    """Token prefixes in whole blocks, each block keyed by the hash of everything up to its end
    (a block is found only after all the blocks before it); least recently used blocks go first."""

    def __init__(self, capacity_tokens: int, block_tokens: int):
        self.block_tokens = max(1, block_tokens)
        self.capacity_blocks = capacity_tokens // self.block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def longest_prefix(self, keys: list[int]) -> int:
        """How many leading blocks of `keys` the cache holds (each found one becomes recent)."""
        found = 0
        for key in keys:
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            found += 1
        return found

    def insert(self, keys: list[int]) -> None:
        if self.capacity_blocks <= 0:
            return
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


def block_keys(token_ids: list[int], block_tokens: int) -> list[int]:
    """Chained hashes of `token_ids`' whole blocks of `block_tokens` (a key names its whole prefix)."""
    keys, key = [], 0
    for end in range(block_tokens, len(token_ids) + 1, block_tokens):
        key = hash((key, tuple(token_ids[end - block_tokens : end])))
        keys.append(key)
    return keys


@dataclass
class _Sequence:
    prompt_ids: list[int]
    tokens: list[int]
    """The whole response, decided at arrival; the engine reveals one token per step."""
    stop_reason: str
    answer: asyncio.Future
    logprobs: bool
    produced: int = 0


class SimulatedEngine:
    """The engine contract (engines/base.py) over a simulated continuous-batching engine."""

    def __init__(self, settings: SimulatedSettings):
        self.settings = settings
        self.stats: dict[str, Any] = dict.fromkeys(COUNTERS.split(), 0) | dict.fromkeys(SECONDS.split(), 0.0)
        self.cache = BlockPrefixCache(settings.prefix_cache_tokens, settings.cache_block_tokens)
        self._draws = random.Random(settings.seed)
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._wake: asyncio.Event | None = None
        self._stepper: asyncio.Task | None = None
        self._stopped = False
        self._step_end: float | None = None
        self._idle_since_step = False

    @property
    def load(self) -> int:
        """Requests in the engine: running and waiting for a slot."""
        return len(self._running) + len(self._waiting)

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_unused: Any
    ) -> EngineOutput:
        if self._stopped:
            raise EngineStopped("the simulated engine is shut down")
        params = SamplingParams.from_request(sampling_params)
        tokens, stop_reason = self._response(prompt_ids, params)
        answer = asyncio.get_running_loop().create_future()
        seq = _Sequence(list(prompt_ids), tokens, stop_reason, answer, params.logprobs)
        self._waiting.append(seq)
        self.stats["requests"] += 1
        self._start()
        return await seq.answer

    def shutdown(self) -> None:
        self._stopped = True
        if self._stepper is not None:
            self._stepper.cancel()
        for seq in [*self._running, *self._waiting]:
            if not seq.answer.done():
                seq.answer.set_exception(EngineStopped("the simulated engine shut down before it answered"))
        self._running, self._waiting = [], deque()

    def _response(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
        s = self.settings
        budget = max(response_budget(s.prompt_length, s.response_length, len(prompt_ids), params.max_tokens), 0)
        wanted = self._length(prompt_ids, params)
        if params.ignore_eos or budget < wanted:
            return answer_tokens(prompt_ids, params, budget, s.vocab_size), STOP_LENGTH
        return answer_tokens(prompt_ids, params, wanted - 1, s.vocab_size) + [s.eos_token_id], STOP_EOS

    def _length(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """A response length (>= 1) from the lognormal around the median."""
        s = self.settings
        if s.response_tokens_sigma <= 0:
            return max(1, s.response_tokens_median)
        draw = self._draws
        if params.seed is not None:
            key = struct.pack(f"<{len(prompt_ids) + 2}q", s.seed, params.seed, *prompt_ids)
            draw = random.Random(hashlib.blake2b(key, digest_size=16).digest())
        normal = draw.gauss(0.0, 1.0)
        share = min(max(s.response_tokens_prompt_share, 0.0), 1.0)
        if share > 0:
            # The prompt's part is keyed by the prompt alone: every replica and every run agree on it.
            key = hashlib.blake2b(
                struct.pack(f"<{len(prompt_ids)}q", *prompt_ids), digest_size=16, person=b"prompt-length"
            )
            normal = math.sqrt(share) * random.Random(key.digest()).gauss(0.0, 1.0) + math.sqrt(1.0 - share) * normal
        return max(1, round(math.exp(math.log(max(1, s.response_tokens_median)) + s.response_tokens_sigma * normal)))

    def _start(self) -> None:
        if self._stepper is None or self._stepper.done():
            self._wake = asyncio.Event()
            self._stepper = asyncio.ensure_future(self._run())
        assert self._wake is not None
        self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while not self._stopped:
            if not self._running and not self._waiting:
                self._wake.clear()
                self._idle_since_step = True
                await self._wake.wait()
                continue
            prefill = self._admit()
            s = self.settings
            step = s.decode_seconds_per_step + s.prefill_seconds_per_token * prefill
            self.stats["running"], self.stats["waiting"] = len(self._running), len(self._waiting)
            self.stats["steps"] += 1
            self.stats["simulated_seconds"] += step
            self.stats["busy_slot_seconds"] += step * len(self._running)
            await self._step_ends(step * s.time_scale)
            self._decode()

    async def _step_ends(self, seconds: float) -> None:
        """A step ends `seconds` after the previous one ended, as a GPU's next kernel follows the
        last: the engine's own Python (admitting, answering) does not stretch its steps. A step
        that could not start on time (this process was busy: its event loop, the server actor
        around it) starts late, and `late_seconds` counts what the engine lost that way."""
        now = asyncio.get_running_loop().time()
        if self._step_end is None or self._idle_since_step:
            self._step_end, self._idle_since_step = now, False
        elif now > self._step_end:
            self.stats["late_seconds"] += now - self._step_end
            self._step_end = now
        self._step_end += seconds
        await asyncio.sleep(self._step_end - now)

    def _admit(self) -> int:
        """Waiting sequences join the batch while a slot is free; the prompt tokens they prefill
        (a prefix in the cache costs nothing, and a joiner's prompt is in the cache for the next)."""
        prefill = 0
        while self._waiting and len(self._running) < self.settings.max_num_seqs:
            seq = self._waiting.popleft()
            keys = block_keys(seq.prompt_ids, self.cache.block_tokens)
            reused = self.cache.longest_prefix(keys) * self.cache.block_tokens
            self.cache.insert(keys)
            prefill += len(seq.prompt_ids) - reused
            self.stats["prefill_tokens"] += len(seq.prompt_ids) - reused
            self.stats["prefix_reused_tokens"] += reused
            self.stats["prefix_hits" if reused else "prefix_misses"] += 1
            self._running.append(seq)
        return prefill

    def _decode(self) -> None:
        """One token for every running sequence; the finished ones answer, and their prompt and
        response stay in the cache (a trajectory's next turn starts with them)."""
        still: list[_Sequence] = []
        for seq in self._running:
            seq.produced += 1
            if seq.produced < len(seq.tokens):
                still.append(seq)
                continue
            self.cache.insert(block_keys(seq.prompt_ids + seq.tokens, self.cache.block_tokens))
            self.stats["generated_tokens"] += len(seq.tokens)
            if not seq.answer.done():
                logprobs = [-1.0] * len(seq.tokens) if seq.logprobs else None
                seq.answer.set_result(
                    EngineOutput(token_ids=seq.tokens, log_probs=logprobs, stop_reason=seq.stop_reason, num_preempted=0)
                )
        self._running = still
        self.stats["running"], self.stats["waiting"] = len(self._running), len(self._waiting)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock advances only where it would wait, by exactly the wait: simulated
    engines, routing clients and their timers run in simulated time, as fast as the CPU allows
    (it never waits for I/O: everything it runs must be in this process)."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualClockLoop):
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None):
        if timeout is not None and timeout > 0:
            self._loop.now += timeout
        return super().select(0)
