"""The transformers engine on a GPU vs plain `model.generate` on the same batch (issue 8, GPU check).

    PYTHONPATH=/tmp/site:$PWD python3 bench/gpu/engine_on_gpu.py MODEL_DIR [--batches 64 256] [--tokens 128]

For each batch size B: B concurrent requests (bundled prompts through the chat template, fixed
length `--tokens` with ignore_eos) go through one `HFEngine` (device=cuda, bfloat16,
max_batch_size = the largest B), and the same B prompts go through one `model.generate` call
(static batch, left padding, min_new_tokens = max_new_tokens = --tokens) on the engine's own
model object. Both greedy, then both sampled (temperature 1.0, what genrun's config sends).
Each figure is the best of --repeats timed runs after a warm-up; the ratio engine / static is
printed side by side, with peak GPU memory.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
import transformers
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


from generation_core.config.bundled import BUNDLED_PROMPTS  # noqa: E402
from generation_core.engines.hf.engine import EngineSettings, HFEngine  # noqa: E402


def prompt_ids(tokenizer, count: int) -> list[list[int]]:
    rows = pq.read_table(BUNDLED_PROMPTS).column("prompt").to_pylist()
    out = []
    for i in range(count):
        chat = [{"role": "user", "content": f"{rows[i % len(rows)][0]['content']} ({i})"}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


async def engine_run(engine: HFEngine, prompts: list[list[int]], tokens: int, temperature: float) -> tuple[int, float]:
    params = {"temperature": temperature, "max_tokens": tokens, "ignore_eos": True}
    started = time.perf_counter()
    outs = await asyncio.gather(
        *[engine.generate(str(i), prompt_ids=p, sampling_params=params) for i, p in enumerate(prompts)]
    )
    seconds = time.perf_counter() - started
    assert all(len(o.token_ids) == tokens for o in outs), "ignore_eos: every response has the fixed length"
    return sum(len(o.token_ids) for o in outs), seconds


def static_run(model, prompts: list[list[int]], tokens: int, temperature: float, pad: int) -> tuple[int, float]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    sample = (
        {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
        if temperature > 0
        else {"do_sample": False}
    )
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=pad, **sample
        )
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return (out.shape[1] - width) * len(prompts), seconds


def best(fn, repeats: int) -> tuple[float, float]:
    """(tokens/s, seconds) of the fastest of `repeats` runs."""
    runs = [fn() for _ in range(repeats)]
    tokens, seconds = min(runs, key=lambda r: r[1] / r[0])
    return tokens / seconds, seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument(
        "--no-cudnn-sdp",
        action="store_true",
        help="torch.backends.cuda.enable_cudnn_sdp(False) for the whole process (engine and static)",
    )
    args = parser.parse_args()
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}, cuDNN SDPA {'off' if args.no_cudnn_sdp else 'on (default)'}"
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    started = time.perf_counter()
    engine = HFEngine(
        EngineSettings(
            args.model_dir,
            prompt_length=256,
            response_length=args.tokens,
            max_batch_size=max(args.batches),
            device="cuda",
            dtype="bfloat16",
        )
    )
    model = engine.model
    print(
        f"engine loaded in {time.perf_counter() - started:.1f} s: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters on {next(model.parameters()).device}, {next(model.parameters()).dtype}, attn {model.config._attn_implementation}"
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 2
    prompts = prompt_ids(tokenizer, max(args.batches))
    lengths = [len(p) for p in prompts]
    print(
        f"prompts: {min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.1f}); responses: {args.tokens} tokens each (ignore_eos)"
    )
    # Warm-up of both paths (CUDA kernels, allocator, cuBLAS handles).
    asyncio.run(engine_run(engine, prompts[:8], 8, 0.0))
    static_run(model, prompts[:8], 8, 0.0, pad)
    rows = []
    for temperature in args.temperatures:
        for batch in args.batches:
            chunk = prompts[:batch]
            steps_before = engine.stats["forward_steps"]
            torch.cuda.reset_peak_memory_stats()
            eng_rate, eng_s = best(
                lambda chunk=chunk, temperature=temperature: asyncio.run(
                    engine_run(engine, chunk, args.tokens, temperature)
                ),
                args.repeats,
            )
            eng_mem = torch.cuda.max_memory_allocated() / 2**30
            steps = (engine.stats["forward_steps"] - steps_before) / args.repeats
            torch.cuda.reset_peak_memory_stats()
            st_rate, st_s = best(
                lambda chunk=chunk, temperature=temperature: static_run(model, chunk, args.tokens, temperature, pad),
                args.repeats,
            )
            st_mem = torch.cuda.max_memory_allocated() / 2**30
            rows.append((temperature, batch, eng_rate, eng_s, steps, eng_mem, st_rate, st_s, st_mem))
            print(
                f"T={temperature:g} batch {batch:4d}: engine {eng_rate:8.1f} tokens/s ({eng_s:6.2f} s, {steps:.0f} forward steps, peak {eng_mem:.2f} GiB) | "
                f"model.generate {st_rate:8.1f} tokens/s ({st_s:6.2f} s, peak {st_mem:.2f} GiB) | engine/static {eng_rate / st_rate:.2f}",
                flush=True,
            )
    engine.shutdown()
    print(
        "\n| sampling | batch | engine tokens/s | model.generate tokens/s | engine / static | engine wall s | static wall s | peak GiB engine / static |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for t, b, er, es, _steps, em, sr, ss, sm in rows:
        label = "greedy" if t == 0 else f"T={t:g}"
        print(f"| {label} | {b} | {er:.1f} | {sr:.1f} | {er / sr:.2f} | {es:.2f} | {ss:.2f} | {em:.2f} / {sm:.2f} |")
    print(
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.used,memory.total", "--format=csv"], capture_output=True, text=True
        ).stdout
    )


if __name__ == "__main__":
    main()
