"""OpenAI batch files at size: a batch JSONL of many requests run undisturbed, and run again
killed part way (in this process: the run stops at once after a committed part, as kill -9 leaves
it) and resumed; both exported with `--format openai-batch`, the two output files compared byte
for byte.

    .venv/bin/python bench/openai_batch.py [--lines 100000] [--kill-after-parts 3]

The instant engine (no model work), n=1, parts of --part-rows trajectories. Printed side by side
from one sitting: the batch file's conversion rate (preflight's check of every line), the two
runs' wall times and their ratio (killed + resumed over undisturbed), the export's rate, and
whether the exports are identical (the issue's requirement; the script exits 1 when they differ).
A 200-line run first warms Ray and the imports up, untimed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Killed(BaseException):
    """Ends the run at once between two parts (what kill -9 leaves)."""


def write_batch(path: Path, lines: int) -> None:
    with open(path, "w") as handle:
        for i in range(lines):
            if i % 2:
                line = {
                    "custom_id": f"chat-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "m",
                        "messages": [{"role": "user", "content": f"Question {i}?"}],
                        "max_tokens": 6,
                        "temperature": 0.7,
                    },
                }
            else:
                line = {
                    "custom_id": f"text-{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"model": "m", "prompt": f"Once upon a time {i}", "seed": i},
                }
            handle.write(json.dumps(line) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--part-rows", type=int, default=5_000)
    parser.add_argument("--kill-after-parts", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="genrun-bench-batch-"))
    os.environ.setdefault("HF_HOME", str(scratch / "hf"))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        return run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(args, scratch: Path) -> int:
    from generation_core.driver.in_process import run_in_process
    from generation_core.exports.export import ExportOptions, export_batch_output
    from generation_core.inputs.openai_batch import BatchLimits, batch_table
    from generation_core.preflight.preflight import preflight
    from generation_core.shard import part_writer

    batch = scratch / "requests.jsonl"
    write_batch(batch, args.lines)
    content = batch.read_bytes()
    started = time.perf_counter()
    batch_table(str(batch), content, BatchLimits(n=1, response_length=16, calculate_log_probs=False))
    convert_seconds = time.perf_counter() - started

    def overrides(out: Path) -> list[str]:
        return [
            f"data.train_files={batch}",
            f"trainer.default_local_dir={out}",
            "actor_rollout_ref.rollout.name=instant",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
            f"generation.save_batch_size={args.part_rows}",
            "generation.show_progress=false",
            "generation.final_merge=false",
            "generation.max_inflight=256",
        ]

    # Warm-up (Ray, the pool's first boot, imports), so that neither timed run pays it alone.
    warm = scratch / "warm.jsonl"
    write_batch(warm, 200)
    run_in_process(preflight([*overrides(scratch / "warm"), f"data.train_files={warm}"]))

    started = time.perf_counter()
    run_in_process(preflight(overrides(scratch / "undisturbed")))
    undisturbed_seconds = time.perf_counter() - started

    writes = 0
    real_failpoint = part_writer.failpoint

    def failpoint(name: str) -> None:
        nonlocal writes
        writes += name == "after_part_write"
        if name == "after_part_write" and writes == args.kill_after_parts:
            raise Killed
        real_failpoint(name)

    part_writer.failpoint = failpoint
    started = time.perf_counter()
    try:
        run_in_process(preflight(overrides(scratch / "crashed")))
        print("the run was not killed: lower --kill-after-parts or --part-rows")
        return 1
    except Killed:
        pass
    finally:
        part_writer.failpoint = real_failpoint
    run_in_process(preflight(overrides(scratch / "crashed")))
    resumed_seconds = time.perf_counter() - started

    started = time.perf_counter()
    export_batch_output(
        str(scratch / "undisturbed"), str(scratch / "undisturbed.jsonl"), ExportOptions(format="openai-batch")
    )
    export_seconds = time.perf_counter() - started
    summary = export_batch_output(
        str(scratch / "crashed"), str(scratch / "resumed.jsonl"), ExportOptions(format="openai-batch")
    )
    # `created` is the time each run took its folder: the two folders differ there, and only there.
    identical = _but_created((scratch / "undisturbed.jsonl").read_bytes()) == _but_created(
        (scratch / "resumed.jsonl").read_bytes()
    )

    print(f"lines: {args.lines}, parts of {args.part_rows}, killed after part {args.kill_after_parts}")
    print(f"conversion (every line checked): {args.lines / convert_seconds:,.0f} lines/s ({convert_seconds:.1f} s)")
    print(
        f"undisturbed run: {undisturbed_seconds:.1f} s; killed + resumed: {resumed_seconds:.1f} s; ratio {resumed_seconds / undisturbed_seconds:.2f}"
    )
    print(
        f"export: {args.lines / export_seconds:,.0f} requests/s ({export_seconds:.1f} s); requests exported {summary.requests}, errors {summary.errors}"
    )
    print(f"resumed export identical to the undisturbed one: {identical}")
    return 0 if identical and summary.requests == args.lines else 1


def _but_created(exported: bytes) -> bytes:
    return re.sub(rb'"created": \d+, ', b"", exported)


if __name__ == "__main__":
    raise SystemExit(main())
