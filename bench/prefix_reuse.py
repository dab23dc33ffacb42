"""Multi-turn throughput of the transformers engine with and without prefix reuse, side by side.

    .venv/bin/python bench/prefix_reuse.py [--conversations 16] [--turns 4] [--tokens 32] [--rounds 2]

A tool rollout's shape: each conversation's next prompt is its previous prompt + the previous
answer (--tokens, greedy, ignore_eos) + a fixed 20-token tool turn; all conversations run at
once (the batch holds them all). Two engines on the bundled model in one process, one reusing
prefixes (the default budget) and one not (prefix_cache_bytes=0), run the same workload in
alternation so that a slower or faster spell of a shared machine hits both; the figures are
generated tokens/s over every round, and the ratio is printed last. Both engines' answers are
compared token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from transformers import AutoTokenizer

from generation_core.config.bundled import prepare_bundled_model
from generation_core.engines.hf.engine import EngineSettings, HFEngine

QUESTIONS = [
    "Name a color.",
    "What is 3 + 4?",
    "Describe rain.",
    "Give a fruit.",
    "Why is the sky blue?",
    "Say hi.",
    "Count to five.",
    "What is a cat?",
]
TOOL_TOKENS = 20


def _first_prompts(tokenizer, count: int) -> list[list[int]]:
    out = []
    for i in range(count):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} Use the tool. ({i})"}],
            add_generation_prompt=True,
            tokenize=True,
        )
        out.append(ids if isinstance(ids, list) else list(ids["input_ids"]))
    return out


def _tool_turn(tokenizer) -> list[int]:
    """A ChatML tool turn of exactly TOOL_TOKENS tokens (its body cut to fit)."""
    head = tokenizer.encode("<|im_start|>tool\n", add_special_tokens=False)
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    body = tokenizer.encode(
        "The tool returned 42, and the lookup found three matching records for the query", add_special_tokens=False
    )
    ids = head + body[: TOOL_TOKENS - len(head) - len(tail)] + tail
    assert len(ids) == TOOL_TOKENS, len(ids)
    return ids


async def _workload(
    engine: HFEngine, prompts: list[list[int]], tool: list[int], turns: int, tokens: int
) -> tuple[list[list[int]], float]:
    params = {"temperature": 0, "max_tokens": tokens, "ignore_eos": True}

    async def conversation(i: int, prompt: list[int]) -> list[int]:
        answers: list[int] = []
        for _ in range(turns):
            out = await engine.generate(f"c{i}", prompt_ids=prompt, sampling_params=params)
            answers += out.token_ids
            prompt = prompt + out.token_ids + tool
        return answers

    started = time.perf_counter()
    answers = await asyncio.gather(*[conversation(i, p) for i, p in enumerate(prompts)])
    return answers, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model_dir = prepare_bundled_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts, tool = _first_prompts(tokenizer, args.conversations), _tool_turn(tokenizer)
    longest = max(map(len, prompts)) + args.turns * (args.tokens + TOOL_TOKENS)

    def engine(prefix_cache_bytes: int | None) -> HFEngine:
        extra = {} if prefix_cache_bytes is None else {"prefix_cache_bytes": prefix_cache_bytes}
        settings = EngineSettings(
            str(model_dir),
            prompt_length=longest,
            response_length=args.tokens,
            max_batch_size=args.conversations,
            num_threads=os.cpu_count(),
            **extra,
        )
        return HFEngine(settings)

    engines = {"reuse on": engine(None), "reuse off": engine(0)}
    for e in engines.values():
        asyncio.run(_workload(e, prompts[:2], tool, 1, 4))  # warm-up
    seconds = dict.fromkeys(engines, 0.0)
    generated = dict.fromkeys(engines, 0)
    answers = {}
    before = {name: dict(e.stats) for name, e in engines.items()}
    for _ in range(args.rounds):
        for name, e in engines.items():
            out, s = asyncio.run(_workload(e, prompts, tool, args.turns, args.tokens))
            seconds[name] += s
            generated[name] += sum(map(len, out))
            answers.setdefault(name, out)
    for e in engines.values():
        e.shutdown()
    rates = {name: generated[name] / seconds[name] for name in engines}
    print(
        f"{args.conversations} conversations x {args.turns} turns, {args.tokens} tokens a turn + {TOOL_TOKENS} tool tokens, {args.rounds} rounds each, alternated"
    )
    for name, e in engines.items():
        stats = {k: e.stats[k] - before[name][k] for k in ("prefill_tokens", "prefix_hits", "prefix_reused_tokens")}
        print(
            f"{name:>9}: {rates[name]:.1f} generated tokens/s ({generated[name]} tokens in {seconds[name]:.1f} s; "
            f"prefilled {stats['prefill_tokens']} prompt tokens, {stats['prefix_hits']} hits reusing {stats['prefix_reused_tokens']})"
        )
    print(f"identical answers: {answers['reuse on'] == answers['reuse off']}")
    print(f"reuse on / reuse off throughput ratio: {rates['reuse on'] / rates['reuse off']:.2f}")


if __name__ == "__main__":
    main()
