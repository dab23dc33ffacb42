"""The transformers engine under streaming load vs a static batch, side by side (issue 6, target 2).

    .venv/bin/python bench/engine_streaming.py [--concurrency 32] [--seconds 40] [--rounds 2] [--smoke]

Static: `model.generate` on `concurrency` prompts, each generating the mean length (a static
batch's best case). Streaming: `concurrency` clients each keep one request in flight, lengths
uniform in [mean/4, 7*mean/4] (`ignore_eos`), counted over a window after the first wave has
finished. Both on the bundled model, greedy, alternated `--rounds` times in one process, with and
without prefix reuse. `--smoke`: 2 clients, 4 tokens, one short round on one thread.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import time

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from generation_core.config.bundled import BUNDLED_PROMPTS, prepare_bundled_model
from generation_core.engines.hf.engine import EngineSettings, HFEngine

TARGET = 0.90


def bundled_prompt_ids(tokenizer, count: int) -> list[list[int]]:
    rows = pq.read_table(BUNDLED_PROMPTS).column("prompt").to_pylist()
    prompts = []
    for i in range(count):
        ids = tokenizer.apply_chat_template(rows[i % len(rows)], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


def static_generate(model, tokenizer, prompts: list[list[int]], tokens: int) -> tuple[int, float]:
    """(tokens generated, seconds) of one `model.generate` call on every prompt, each generating
    exactly `tokens`."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    started = time.perf_counter()
    with torch.inference_mode():
        fixed_length = dict(max_new_tokens=tokens, min_new_tokens=tokens)
        out = model.generate(input_ids=ids, attention_mask=mask, **fixed_length, do_sample=False, pad_token_id=pad)
    seconds = time.perf_counter() - started
    return (out.shape[1] - width) * len(prompts), seconds


async def streaming(
    engine: HFEngine, prompts: list[list[int]], concurrency: int, mean_tokens: int, seconds: float, seed: int
) -> float:
    """tokens/s of the engine while `concurrency` clients keep one request each in flight."""
    rng = random.Random(seed)
    low, high = max(1, mean_tokens // 4), mean_tokens * 7 // 4
    finished = 0
    window: dict[str, float] = {}
    stop = asyncio.Event()

    async def client(worker: int) -> None:
        nonlocal finished
        n = worker
        while not stop.is_set():
            params = {"temperature": 0, "max_tokens": rng.randint(low, high), "ignore_eos": True}
            await engine.generate(f"{worker}-{n}", prompt_ids=prompts[n % len(prompts)], sampling_params=params)
            n += concurrency
            finished += 1
            if finished == concurrency and "start" not in window:
                # The first wave is done: from here on, requests arrive as earlier ones finish.
                window["start"], window["tokens_at_start"] = time.perf_counter(), engine.stats["generated_tokens"]

    async def timer() -> None:
        while "start" not in window:
            await asyncio.sleep(0.05)
        await asyncio.sleep(seconds)
        window["end"], window["tokens_at_end"] = time.perf_counter(), engine.stats["generated_tokens"]
        stop.set()

    await asyncio.gather(timer(), *[client(w) for w in range(concurrency)])
    return (window["tokens_at_end"] - window["tokens_at_start"]) / (window["end"] - window["start"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--mean-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="seconds: 2 clients, 4 tokens, one round")
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.mean_tokens, args.seconds, args.rounds = 2, 4, 1.0, 1
    model_dir = prepare_bundled_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    threads = 1 if args.smoke else os.cpu_count()
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    lengths = dict(prompt_length=512, response_length=args.mean_tokens * 2)
    settings = EngineSettings(str(model_dir), **lengths, max_batch_size=args.concurrency, num_threads=threads)
    # The bundled prompts repeat over the run (48 of them), and every one starts with the same
    # system prompt: the default engine reuses those prefixes, which a static batch cannot. The
    # engine without any prefix reuse runs beside it, so the gain of each part shows.
    engines = {"default": HFEngine(settings)}
    if not args.smoke:
        engines["no prefix reuse"] = HFEngine(dataclasses.replace(settings, prefix_cache_bytes=0))
    prompts = bundled_prompt_ids(tokenizer, 4 * args.concurrency)
    static_generate(model, tokenizer, prompts[:4], 4)  # warm-up
    static_rates, streaming_rates = [], {name: [] for name in engines}
    for round_ in range(args.rounds):
        generated, seconds = static_generate(model, tokenizer, prompts[: args.concurrency], args.mean_tokens)
        static_rates.append(generated / seconds)
        for name, engine in engines.items():
            load = streaming(engine, prompts, args.concurrency, args.mean_tokens, args.seconds, seed=round_)
            streaming_rates[name].append(asyncio.run(load))
        streamed = ", ".join(f"engine streaming ({name}) {r[-1]:.1f} tokens/s" for name, r in streaming_rates.items())
        print(f"round {round_ + 1}: static model.generate {static_rates[-1]:.1f} tokens/s, {streamed}", flush=True)
    for engine in engines.values():
        engine.shutdown()
    static = sum(static_rates) / len(static_rates)
    low, high = max(1, args.mean_tokens // 4), args.mean_tokens * 7 // 4
    print(
        f"concurrency {args.concurrency}, streaming lengths uniform in [{low}, {high}], static length {args.mean_tokens}"
    )
    print(f"static batch (model.generate): {static:.1f} tokens/s")
    for name, rates in streaming_rates.items():
        stream = sum(rates) / len(rates)
        print(
            f"streaming ({name}) / static throughput: {stream / static:.2f} ({stream:.1f} tokens/s; target {TARGET:.2f})"
        )


if __name__ == "__main__":
    main()
