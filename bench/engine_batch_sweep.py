"""The transformers engine's decode batch (`rollout.max_num_seqs`) swept on this machine: where
the CPU default comes from.

    .venv/bin/python -u bench/engine_batch_sweep.py [--batches 16 32 64 96 128] [--seconds 20]

For each batch size B, one engine with max_num_seqs=B under streaming load from B clients
(bench/engine_streaming.py's load: response lengths uniform in [16, 112], greedy, ignore_eos),
tokens/s counted over a window after the first wave. Every size runs in the same process, in
the order given, then again in reverse (a drifting machine shows as the two passes disagreeing);
the mean of both passes is printed with the ratio to the best size.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import torch
from engine_streaming import bundled_prompt_ids, streaming
from transformers import AutoTokenizer

from generation_core.config.bundled import prepare_bundled_model
from generation_core.engines.hf.engine import EngineSettings, HFEngine


def rate(model_dir, prompts, batch: int, seconds: float, seed: int) -> float:
    engine = HFEngine(
        EngineSettings(
            str(model_dir), prompt_length=512, response_length=128, max_batch_size=batch, num_threads=os.cpu_count()
        )
    )
    try:
        return asyncio.run(streaming(engine, prompts, batch, 64, seconds, seed))
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 96, 128])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    model_dir = prepare_bundled_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    torch.set_num_threads(os.cpu_count())
    prompts = bundled_prompt_ids(tokenizer, 4 * max(args.batches))
    rates: dict[int, list[float]] = {b: [] for b in args.batches}
    for seed, order in enumerate((args.batches, list(reversed(args.batches)))):
        for batch in order:
            rates[batch].append(rate(model_dir, prompts, batch, args.seconds, seed))
            print(f"pass {seed + 1}: max_num_seqs {batch}: {rates[batch][-1]:.1f} tokens/s", flush=True)
    means = {b: sum(r) / len(r) for b, r in rates.items()}
    best = max(means, key=means.get)
    for batch, mean in means.items():
        print(f"max_num_seqs {batch:4d}: {mean:6.1f} tokens/s  ({mean / means[best]:.2f} of the best, {batch})")
    print(f"best: max_num_seqs {best}")


if __name__ == "__main__":
    main()
