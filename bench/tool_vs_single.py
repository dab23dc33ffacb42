"""Tokens/s of the tool-calling example against single-turn generation, whole `genrun` runs side by side.

    .venv/bin/python -u bench/tool_vs_single.py [--rounds 1] [--prompts 192] [--as-shipped] [--arrival-order-too]
        [--own-prefix-too]

Each round runs, one after the other on the bundled CPU model, single-turn generation on the
bundled prompts and the tool-calling example (examples/tool_calling: verl's ToolAgentLoop with
the calculator, the README's command), each into a fresh folder. By default both runs get
--prompts rows (each dataset repeated) and the example's lengths (prompt 256, response 256), so
that the ratio compares the cost per model token of multi-turn rollouts with single-turn ones
rather than the tails of two small runs. --as-shipped compares the commands as a user first runs
them: `make demo` (48 prompts, response 128) against the example's 24 questions repeated to 48
(response 256): those runs are short enough that their slowest trajectory sets their length.
Rates are the runs' own figure (model tokens / shard seconds, `this_invocation.tokens_per_second`
in manifest.json). Also printed: how many tool trajectories had more than one model turn.
Every run samples with generation.sample_seed (--seed): two runs of one sitting then draw the same
random numbers for the same trajectory, and the number of tool calls (which sets how much of a
run is later turns) no longer varies from run to run (31 to 58 of 192 multi-turn unseeded).
--arrival-order-too adds, in each round, the tool example with the engine admitting requests in
arrival order (engine_kwargs.hf.later_turns_first=false) instead of a trajectory's later turns first.
--later-vs-arrival runs only the tool example, with later_turns_first true and false, alternating
which goes first from round to round (no single-turn runs), and prints their ratio.
--own-prefix-too adds, in each round, the tool example with every sequence reading its own copy of
the shared system prompt's KV (engine_kwargs.hf.shared_prefix_attention=false).
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

from generation_core.config.bundled import BUNDLED_PROMPTS  # noqa: E402

TOOLS = REPO / "examples" / "tool_calling"
TARGET = 0.8


def repeated_rows(source: Path, path: Path, count: int) -> None:
    rows = pq.read_table(source).to_pylist()
    out = []
    for i in range(count):
        row = json.loads(json.dumps(rows[i % len(rows)]))
        row["extra_info"] = dict(row.get("extra_info") or {}, index=i)
        out.append(row)
    pq.write_table(pa.Table.from_pylist(out), path)


def run(scratch: Path, name: str, overrides: list[str]) -> dict:
    out = scratch / name
    command = [GENRUN, f"trainer.default_local_dir={out}", "generation.show_progress=false", *overrides]
    started = time.time()
    finished = subprocess.run(
        command, cwd=REPO, env=genrun_env(scratch / f"{name}.timeline"), capture_output=True, text=True
    )
    if finished.returncode != 0:
        sys.exit(f"{name}: genrun failed ({finished.returncode}):\n{finished.stderr[-3000:]}")
    summary = json.loads((out / "manifest.json").read_text())
    now = summary["this_invocation"]
    turns = multi_turn(out)
    print(
        f"  {name}: {now['trajectories']} trajectories, {now['generated_tokens']} model tokens in {now['generation_seconds']} s "
        f"= {now['tokens_per_second']} tokens/s; {turns} with more than one model turn; whole command {time.time() - started:.0f} s",
        flush=True,
    )
    return now


def multi_turn(out: Path) -> int:
    from generation_core.store.folder import StorageFolder
    from generation_core.store.part_repair import committed_parts, read_verified_part
    from generation_core.store.trajectory_record import records_from_parquet

    folder = StorageFolder(str(out))
    count = 0
    for part in committed_parts(folder):
        for record in records_from_parquet(read_verified_part(folder, part)):
            mask = record.response_mask
            # A model turn starts where the mask goes 0 -> 1 after tool tokens.
            count += any(a == 0 and b == 1 for a, b in zip(mask, mask[1:], strict=False))
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--as-shipped", action="store_true")
    parser.add_argument("--arrival-order-too", action="store_true")
    parser.add_argument("--own-prefix-too", action="store_true")
    parser.add_argument("--later-vs-arrival", action="store_true")
    parser.add_argument("--seed", type=int, default=7, help="generation.sample_seed of every run")
    args = parser.parse_args()
    prompts = 48 if args.as_shipped else args.prompts
    scratch = Path(tempfile.mkdtemp(prefix="genrun-tool-vs-single-"))
    try:
        questions = scratch / "arithmetic.parquet"
        repeated_rows(TOOLS / "data" / "arithmetic.parquet", questions, prompts)
        single: list[str] = []
        if not args.as_shipped:
            chats = scratch / "chats.parquet"
            repeated_rows(BUNDLED_PROMPTS, chats, prompts)
            single = [f"data.train_files={chats}", "data.max_prompt_length=256", "data.max_response_length=256"]
        tool = [
            f"data.train_files={questions}",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS / 'tools.yaml'}",
            f"reward.custom_reward_function.path={TOOLS / 'reward.py'}",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "data.max_prompt_length=256",
            "data.max_response_length=256",
        ]
        seeded = f"generation.sample_seed={args.seed}"
        single, tool = [*single, seeded], [*tool, seeded]
        rates: dict[str, list[float]] = {"single": [], "tool": [], "tool-arrival-order": [], "tool-own-prefix": []}
        if args.later_vs_arrival:
            later_vs_arrival(scratch, tool, args.rounds, prompts)
            return
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}", flush=True)
            rates["single"].append(run(scratch, f"single-{round_}", single)["tokens_per_second"])
            rates["tool"].append(run(scratch, f"tool-{round_}", tool)["tokens_per_second"])
            if args.arrival_order_too:
                arrival = [*tool, "actor_rollout_ref.rollout.engine_kwargs.hf.later_turns_first=false"]
                rates["tool-arrival-order"].append(
                    run(scratch, f"tool-arrival-order-{round_}", arrival)["tokens_per_second"]
                )
            if args.own_prefix_too:
                own = [*tool, "actor_rollout_ref.rollout.engine_kwargs.hf.shared_prefix_attention=false"]
                rates["tool-own-prefix"].append(run(scratch, f"tool-own-prefix-{round_}", own)["tokens_per_second"])
        mean = {name: sum(values) / len(values) for name, values in rates.items() if values}
        single_rate, tool_rate = mean["single"], mean["tool"]
        print(
            f"{prompts} prompts each, {'as shipped' if args.as_shipped else 'prompt 256 / response 256'}: single-turn {single_rate:.1f} tokens/s; tool example {tool_rate:.1f} tokens/s"
        )
        print(f"tool / single-turn: {tool_rate / single_rate:.2f} (target >= {TARGET})")
        if "tool-arrival-order" in mean:
            print(
                f"tool example, arrival order: {mean['tool-arrival-order']:.1f} tokens/s = {mean['tool-arrival-order'] / single_rate:.2f} of single-turn"
            )
        if "tool-own-prefix" in mean:
            own_rate = mean["tool-own-prefix"]
            print(
                f"tool example, each sequence reading its own prefix copy: {own_rate:.1f} tokens/s = {own_rate / single_rate:.2f} of single-turn; shared prefix read once: {tool_rate / own_rate:.2f}x"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def later_vs_arrival(scratch: Path, tool: list[str], rounds: int, prompts: int) -> None:
    """The tool example with later turns first and in arrival order, the same seeded work,
    alternating which runs first (a sitting's drift falls on both alike)."""
    setting = "actor_rollout_ref.rollout.engine_kwargs.hf.later_turns_first"
    rates: dict[str, list[float]] = {"later": [], "arrival": []}
    for round_ in range(rounds):
        print(f"round {round_ + 1}", flush=True)
        order = ("later", "arrival") if round_ % 2 == 0 else ("arrival", "later")
        for name in order:
            overrides = [*tool, f"{setting}={'true' if name == 'later' else 'false'}"]
            rates[name].append(run(scratch, f"tool-{name}-{round_}", overrides)["tokens_per_second"])
    later, arrival = (sum(v) / len(v) for v in (rates["later"], rates["arrival"]))
    print(
        f"{prompts} prompts, tool example: later turns first {later:.1f} tokens/s {rates['later']}; arrival order {arrival:.1f} tokens/s {rates['arrival']}"
    )
    print(f"later turns first / arrival order: {later / arrival:.2f}")


if __name__ == "__main__":
    main()
