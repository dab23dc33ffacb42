"""Batch-1 vs batch-32 throughput of the transformers engine, measured side by side.

    .venv/bin/python bench/engine_batching.py [--tokens 32] [--batch 32]

Both figures come from the same engine instance in the same process, one after the other, on
the bundled model with greedy decoding; the ratio is printed last.
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


def _prompts(tokenizer, count: int) -> list[list[int]]:
    out = []
    for i in range(count):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
            add_generation_prompt=True,
            tokenize=True,
        )
        out.append(ids if isinstance(ids, list) else list(ids["input_ids"]))
    return out


async def _run(engine: HFEngine, prompts: list[list[int]], tokens: int) -> tuple[int, float]:
    params = {"temperature": 0, "max_tokens": tokens}
    started = time.perf_counter()
    outs = await asyncio.gather(
        *[engine.generate(str(i), prompt_ids=p, sampling_params=params) for i, p in enumerate(prompts)]
    )
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    model_dir = prepare_bundled_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engine = HFEngine(
        EngineSettings(
            str(model_dir),
            prompt_length=256,
            response_length=args.tokens,
            max_batch_size=args.batch,
            num_threads=os.cpu_count(),
        )
    )
    prompts = _prompts(tokenizer, args.batch)
    asyncio.run(_run(engine, prompts[:2], 4))  # warm-up
    single_tokens, single_seconds = 0, 0.0
    for prompt in prompts[:4]:
        n, s = asyncio.run(_run(engine, [prompt], args.tokens))
        single_tokens, single_seconds = single_tokens + n, single_seconds + s
    batch_tokens, batch_seconds = asyncio.run(_run(engine, prompts, args.tokens))
    engine.shutdown()
    single_rate, batch_rate = single_tokens / single_seconds, batch_tokens / batch_seconds
    print(f"batch 1:  {single_rate:.1f} tokens/s ({single_tokens} tokens, 4 requests one at a time)")
    print(f"batch {args.batch}: {batch_rate:.1f} tokens/s ({batch_tokens} tokens, {args.batch} concurrent requests)")
    print(f"batch-{args.batch} / batch-1 throughput ratio: {batch_rate / single_rate:.2f}")


if __name__ == "__main__":
    main()
