"""What a decode step costs at the few rows a run's drain decodes: the transformers engine against a
plain transformers forward at the same rows, side by side (the bundled model, 2 threads).

    .venv/bin/python -u bench/small_batch_steps.py [--rows 1 2 4 8 16 32 64] [--context 300]

At the end of a run the batch drains: no request is waiting, and the last trajectories decode a
few rows per step (bench/RESULTS.md, "Where the tool run loses"). Whether those steps cost what
the model costs, or the engine adds to them, is what this prints:
- plain: `model(next_tokens, past_key_values=cache)` for R rows of `--context` tokens each (a
  transformers DynamicCache, last-position logits), median of 8 steps;
- engine: HFEngine (the run's settings: mixed steps, shared-prefix attention, sampling at
  temperature 1) decoding R concurrent requests with prompts of `--context` tokens and fixed
  lengths (ignore_eos). Its decode cost per step is taken as the difference between a run of 60
  and a run of 20 tokens, so the prefill and joins cancel out (the engine's own counters:
  forward_steps, busy_seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from generation_core.config.bundled import prepare_bundled_model  # noqa: E402
from generation_core.engines.hf.engine import EngineSettings, HFEngine  # noqa: E402

THREADS = 2


def plain_step_ms(model, rows: int, context: int) -> float:
    from transformers import DynamicCache

    ids = torch.randint(100, 5000, (rows, context))
    with torch.inference_mode():
        cache = DynamicCache()
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = torch.randint(100, 5000, (rows, 1))
        times = []
        for _ in range(8):
            started = time.perf_counter()
            model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


async def engine_step_ms(engine: HFEngine, rows: int, context: int) -> float:
    async def run(tokens: int, tag: int) -> tuple[int, float]:
        before = dict(engine.stats)
        await asyncio.gather(
            *[
                engine.generate(
                    f"{tag}-{rows}-{i}",
                    # Distinct prompts: no prefix shared between them, as the drain's conversations.
                    prompt_ids=[(7 * i + 13 * j + 3 * tag) % 5000 + 100 for j in range(context)],
                    sampling_params={"temperature": 1.0, "max_tokens": tokens},
                )
                for i in range(rows)
            ]
        )
        return engine.stats["forward_steps"] - before["forward_steps"], engine.stats["busy_seconds"] - before[
            "busy_seconds"
        ]

    short_steps, short_seconds = await run(20, 1)
    long_steps, long_seconds = await run(60, 2)
    return 1000 * (long_seconds - short_seconds) / (long_steps - short_steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    path = str(prepare_bundled_model())
    engine = HFEngine(
        EngineSettings(
            model_path=path,
            prompt_length=args.context + 64,
            response_length=128,
            max_batch_size=max(args.rows),
            num_threads=THREADS,
            ignore_eos=True,
        )
    )
    try:
        print(f"bundled model, {THREADS} threads, context {args.context} tokens: ms per decode step")
        print(f"{'rows':>5} {'plain':>8} {'engine':>8} {'engine/plain':>13}")
        for rows in args.rows:
            plain = plain_step_ms(engine.model, rows, args.context)
            mine = asyncio.run(engine_step_ms(engine, rows, args.context))
            print(f"{rows:>5} {plain:>8.1f} {mine:>8.1f} {mine / plain:>13.2f}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
