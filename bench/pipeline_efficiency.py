"""Pipeline efficiency: tokens/s of full `genrun` runs over the engine's best static batch (issue 6, target 1).

    .venv/bin/python bench/pipeline_efficiency.py [--prompts 128] [--tokens 64] [--smoke]

One process run, side by side: `model.generate` on the same prompts and lengths at static
batch sizes 32 and 64 (the best counts; 32 is the engine's max_num_seqs), then the whole pipeline (`genrun`: Prefect flow,
Ray, shard tasks, verl agent loops, parts and checkpoints, merge, zip) at 1 and 2 shards. Every
response has exactly `--tokens` tokens on both sides (`engine_kwargs.hf.ignore_eos=true` and
`min_new_tokens`), so the token counts are equal by construction.

Two ratios per run, from the run's timeline (generation_core/instrumentation.py):
  - generation phase: tokens / (first shard worker ready with the engine up -> last shard
    done): what the pipeline delivers while it generates;
  - end to end: tokens / the whole command (Python start, Prefect server, Ray, model load,
    generation, merge, zip): startup is a fixed ~40-50 s on 2 cores, so this ratio depends
    on the run's size and is printed for the size used.
The generation-phase ratios are printed last (target >= 0.90). `--smoke`: 4 prompts x 2 tokens
on the static side, and genrun's input checks of the two commands instead of the runs.
`genrun bench` measures the same ratio with the run's own sampling and batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_streaming import bundled_prompt_ids, static_generate  # noqa: E402
from genrun_process import GENRUN, REPO, check_command, genrun_env  # noqa: E402

from generation_core.config.bundled import BUNDLED_PROMPTS, prepare_bundled_model  # noqa: E402
from generation_core.instrumentation import generation_phase_seconds, read_timeline  # noqa: E402

TARGET = 0.90


def write_prompts(path: Path, count: int) -> None:
    chats = pq.read_table(BUNDLED_PROMPTS).column("prompt").to_pylist()
    rows = [{"data_source": "bench", "prompt": chats[i % len(chats)], "extra_info": {"index": i}} for i in range(count)]
    pq.write_table(pa.Table.from_pylist(rows), path)


def best_static_rate(model, tokenizer, prompts: list[list[int]], tokens: int, batches: tuple[int, ...]):
    """The best tokens/s of model.generate over static batch sizes, all prompts once each."""
    best = (0.0, 0)
    for batch in batches:
        runs = [
            static_generate(model, tokenizer, prompts[i : i + batch], tokens) for i in range(0, len(prompts), batch)
        ]
        rate = sum(generated for generated, _ in runs) / sum(seconds for _, seconds in runs)
        print(f"  model.generate static batch {batch}: {rate:.1f} tokens/s")
        best = max(best, (rate, batch))
    return best


def pipeline_arguments(prompts_file: Path, out: Path, tokens: int, shards: int) -> list[str]:
    return [
        f"data.train_files={prompts_file}",
        f"trainer.default_local_dir={out}",
        f"data.max_response_length={tokens}",
        "actor_rollout_ref.rollout.engine_kwargs.hf.ignore_eos=true",
        f"generation.num_shards={shards}",
        "generation.show_progress=false",
    ]


def pipeline_run(scratch: Path, prompts_file: Path, tokens: int, shards: int) -> dict[str, float]:
    timeline = scratch / f"timeline-{shards}.txt"
    out = scratch / f"run-{shards}"
    command = [GENRUN, *pipeline_arguments(prompts_file, out, tokens, shards)]
    started = time.time()
    finished = subprocess.run(command, cwd=REPO, env=genrun_env(timeline), capture_output=True, text=True)
    total = time.time() - started
    if finished.returncode != 0:
        sys.exit(f"genrun failed ({finished.returncode}):\n{finished.stderr[-3000:]}")
    manifest = json.loads((out / "manifest.json").read_text())
    generation_seconds = generation_phase_seconds(read_timeline(timeline))
    return {
        "tokens": manifest["generated_tokens"],
        "trajectories": manifest["num_trajectories"],
        "generation_seconds": generation_seconds,
        "total_seconds": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="seconds: tiny static batches, genrun's checks, no run")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.tokens = 4, 2
    model_dir = prepare_bundled_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    scratch = Path(tempfile.mkdtemp(prefix="genrun-efficiency-"))
    try:
        prompts_file = scratch / "prompts.parquet"
        write_prompts(prompts_file, args.prompts)
        prompts = bundled_prompt_ids(tokenizer, args.prompts)
        torch.set_num_threads(1 if args.smoke else os.cpu_count())
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        print(f"{args.prompts} prompts x {args.tokens} tokens, bundled model, {os.cpu_count()} cores")
        static, batch = best_static_rate(model, tokenizer, prompts, args.tokens, (2, 4) if args.smoke else (32, 64))
        del model
        if args.smoke:
            for shards in (1, 2):
                check_command(pipeline_arguments(prompts_file, scratch / f"run-{shards}", args.tokens, shards))
            return
        runs = {}
        for shards in (1, 2):
            runs[shards] = result = pipeline_run(scratch, prompts_file, args.tokens, shards)
            phase = result["tokens"] / result["generation_seconds"]
            whole = result["tokens"] / result["total_seconds"]
            print(
                f"  genrun, {shards} shard(s): {result['trajectories']} trajectories, {result['tokens']} tokens; generation phase "
                f"{result['generation_seconds']:.1f} s = {phase:.1f} tokens/s; whole command {result['total_seconds']:.1f} s = {whole:.1f} tokens/s"
            )
        print(f"best static batch: {static:.1f} tokens/s (batch {batch})")
        for shards, result in runs.items():
            print(
                f"end to end / static, {shards} shard(s), this size: {result['tokens'] / result['total_seconds'] / static:.2f}"
            )
        for shards, result in runs.items():
            print(
                f"pipeline efficiency (generation phase / static), {shards} shard(s): {result['tokens'] / result['generation_seconds'] / static:.2f} (target {TARGET:.2f})"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
