"""Tokens/s of the tool-calling example against the single-turn demo, whole `genrun` runs side by side.

    .venv/bin/python -u bench/tool_vs_single.py [--rounds 1] [--prompts 48]

Each round runs, one after the other on the bundled CPU model, the single-turn demo (`genrun` on
the bundled prompts, as `make demo`) and the tool-calling example (examples/tool_calling: verl's
ToolAgentLoop with the calculator, the README's command), each into a fresh folder. Rates are the
runs' own figure (model tokens / shard seconds, `this_invocation.tokens_per_second` in
manifest.json). The example's dataset is repeated to --prompts rows so that both runs keep the
engine's batch equally full (the example ships 24 questions, the demo 48 prompts). Also printed:
how many tool trajectories had more than one model turn, and the engine's prefix reuse.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from genrun_process import GENRUN, REPO, genrun_env  # noqa: E402

TOOLS = REPO / "examples" / "tool_calling"
TARGET = 0.8


def repeated_questions(path: Path, count: int) -> None:
    rows = pq.read_table(TOOLS / "data" / "arithmetic.parquet").to_pylist()
    out = []
    for i in range(count):
        row = json.loads(json.dumps(rows[i % len(rows)]))
        row["extra_info"]["index"] = i
        out.append(row)
    pq.write_table(pa.Table.from_pylist(out), path)


def run(scratch: Path, name: str, overrides: list[str]) -> dict:
    out = scratch / name
    command = [GENRUN, f"trainer.default_local_dir={out}", "generation.show_progress=false", *overrides]
    started = time.time()
    finished = subprocess.run(command, cwd=REPO, env=genrun_env(scratch / f"{name}.timeline"), capture_output=True, text=True)
    if finished.returncode != 0:
        sys.exit(f"{name}: genrun failed ({finished.returncode}):\n{finished.stderr[-3000:]}")
    summary = json.loads((out / "manifest.json").read_text())
    now = summary["this_invocation"]
    turns = multi_turn(out)
    print(f"  {name}: {now['trajectories']} trajectories, {now['generated_tokens']} model tokens in {now['generation_seconds']} s "
          f"= {now['tokens_per_second']} tokens/s; {turns} with more than one model turn; whole command {time.time() - started:.0f} s", flush=True)
    return now


def multi_turn(out: Path) -> int:
    from generation_core.records import records_from_parquet
    from generation_core.run_folder import committed_parts, read_verified_part
    from generation_core.storage import RunFolder

    folder = RunFolder(str(out))
    count = 0
    for part in committed_parts(folder):
        for record in records_from_parquet(read_verified_part(folder, part)):
            mask = record.response_mask
            # A model turn starts where the mask goes 0 -> 1 after tool tokens.
            count += any(a == 0 and b == 1 for a, b in zip(mask, mask[1:]))
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=48)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="genrun-tool-vs-single-"))
    try:
        questions = scratch / "arithmetic.parquet"
        repeated_questions(questions, args.prompts)
        tool = [
            f"data.train_files={questions}",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS / 'tools.yaml'}",
            f"reward.custom_reward_function.path={TOOLS / 'reward.py'}",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "data.max_prompt_length=256", "data.max_response_length=256",
        ]
        rates: dict[str, list[float]] = {"single": [], "tool": []}
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}", flush=True)
            rates["single"].append(run(scratch, f"single-{round_}", [])["tokens_per_second"])
            rates["tool"].append(run(scratch, f"tool-{round_}", tool)["tokens_per_second"])
        single = sum(rates["single"]) / len(rates["single"])
        tool_rate = sum(rates["tool"]) / len(rates["tool"])
        print(f"single-turn demo: {single:.1f} tokens/s; tool example: {tool_rate:.1f} tokens/s")
        print(f"tool / single-turn: {tool_rate / single:.2f} (target >= {TARGET})")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
