"""CPU time per trajectory of a whole `genrun` run, per process role (issue 46 item 1).

    .venv/bin/python bench/cpu_per_trajectory.py [--tree DIR] [--prompts 8000] [--n 1] [--example single|tool]

`genrun` as a user runs it (instant engine, one shard, parts of 1,000) on the source tree `--tree`
(default: this checkout; an old commit: `git worktree add /tmp/wt-SHA SHA`, run with this venv),
every process it starts followed until all are gone (bench/process_roles.py). Per role, CPU us per
trajectory over the generation phase and over each process's life; "genrun's own" is the driver,
shard worker, registry, progress board and server actor less the instant engine's own compute
(timed in process on the same tree). `--smoke`: genrun's checks of the command, the sampler.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from genrun_process import GENRUN, REPO, check_command, genrun_env, write_prompts
from process_roles import follow

from generation_core.benchmark.process_cpu import GENRUN_OWN_ROLES
from generation_core.instrumentation import generation_phase, read_timeline

OWN_ROLES = (*GENRUN_OWN_ROLES, "server actor")


def genrun_arguments(args: argparse.Namespace, prompts: Path, out: Path) -> list[str]:
    arguments = [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        "generation.show_progress=false",
        "generation.save_batch_size=1000",
        "generation.num_shards=1",
        f"actor_rollout_ref.rollout.n={args.n}",
    ]
    if args.example == "tool":
        tools = REPO / "examples" / "tool_calling"
        arguments += [
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools / 'tools.yaml'}",
            f"reward.custom_reward_function.path={tools / 'reward.py'}",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "data.max_prompt_length=256",
            "data.max_response_length=256",
        ]
    return arguments + list(args.override)


# The instant engine's own compute per request, timed in process on the tree under test.
_ENGINE_COST = """
import asyncio, sys, time
from generation_core.engines.instant import InstantEngine, InstantSettings
engine = InstantEngine(InstantSettings(prompt_length=1024, response_length=1024, eos_token_id=2))
prompt = list(range(100, 130))
params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
async def calls(count):
    for i in range(count):
        await engine.generate(str(i), prompt_ids=prompt, sampling_params=params)
asyncio.run(calls(200))
started = time.process_time()
asyncio.run(calls(int(sys.argv[1])))
print((time.process_time() - started) / int(sys.argv[1]))
"""


def engine_seconds_per_call(tree: Path, calls: int = 5000) -> float | None:
    command = [sys.executable, "-c", _ENGINE_COST, str(calls)]
    done = subprocess.run(command, env=dict(os.environ, PYTHONPATH=str(tree)), cwd=tree, capture_output=True, text=True)
    return float(done.stdout.strip()) if done.returncode == 0 else None


def run_once(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="genrun-cpu-", ignore_cleanup_errors=True) as scratch:
        prompts, out, timeline = (Path(scratch) / name for name in ("prompts.parquet", "run", "timeline.txt"))
        write_prompts(prompts, args.prompts, args.example)
        started = time.time()
        with open(Path(scratch) / "stderr", "w+") as stderr:
            command, env = [GENRUN, *genrun_arguments(args, prompts, out)], genrun_env(timeline)
            env["PYTHONPATH"] = str(args.tree)
            child = subprocess.Popen(command, cwd=args.tree, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            processes = follow(child, 0.2, linger=30.0)
            if child.returncode != 0:
                stderr.seek(0)
                raise SystemExit(f"genrun failed ({child.returncode}):\n{stderr.read()[-3000:]}")
        phase_start, phase_end = generation_phase(read_timeline(timeline))
        trajectories = json.loads((out / "manifest.json").read_text())["num_trajectories"]
    assert processes.exited_at is not None
    return {
        "tree": str(args.tree),
        "trajectories": trajectories,
        # The instant engine never writes a tool call: every trajectory (the tool example's too) is one request.
        "requests": trajectories,
        "phase_seconds": phase_end - phase_start,
        "command_seconds": processes.exited_at - started,
        "roles": processes.roles(phase_start, phase_end),
    }


# --smoke: a parent and a child that burn a known amount of CPU, followed as a run is.
_BURN = "import sys, time\nend = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\n"
_SMOKE_TREE = _BURN + "import subprocess\nsubprocess.run([sys.executable, '-c', __doc__, '0.3'])\n"


def smoke(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="genrun-cpu-smoke-") as scratch:
        write_prompts(Path(scratch) / "prompts.parquet", 300, args.example)
        check_command(genrun_arguments(args, Path(scratch) / "prompts.parquet", Path(scratch) / "run"))
    tree = f"__doc__ = {_BURN!r}\n{_SMOKE_TREE}"
    processes = follow(subprocess.Popen([sys.executable, "-c", tree, "0.2"]), 0.05, linger=30.0)
    roles = processes.roles(0.0, time.time())
    cpu = sum(row["life"] for row in roles.values())
    print(f"smoke: {len(processes.processes)} processes followed, {cpu:.2f} CPU-s (about 0.5 burnt): {roles}")
    assert len(processes.processes) == 2 and 0.3 <= cpu <= 1.5, roles


def report(result: dict, engine_call: float | None) -> None:
    count, roles = result["trajectories"], result["roles"]
    print(
        f"tree {result['tree']}: {count} trajectories; generation phase {result['phase_seconds']:.2f} s = "
        f"{count / result['phase_seconds']:.0f} trajectories/s, whole command {result['command_seconds']:.1f} s "
        "(wall clock: measured under whatever load the machine had)"
    )
    print(f"  {'role':22s} {'procs':>5s} {'phase us/traj':>14s} {'life us/traj':>13s}")
    rows = sorted(roles.items(), key=lambda item: -item[1]["life"])
    totals = {key: sum(row[key] for row in roles.values()) for key in ("phase", "life")}
    for role, row in [*rows, ("all processes", dict(totals, processes=""))]:
        print(
            f"  {role:22s} {row['processes']:>5} {row['phase'] / count * 1e6:14.0f} {row['life'] / count * 1e6:13.0f}"
        )
    engine = (engine_call or 0.0) * result["requests"]
    own = {key: (sum(roles[r][key] for r in OWN_ROLES if r in roles) - engine) / count * 1e6 for key in totals}
    print(
        f"  genrun's own (driver, shard worker, registry, progress board, server actor less the engine's compute"
        f" {engine_call * 1e6 if engine_call else float('nan'):.1f} us/request): "
        f"phase {own['phase']:.0f} us/trajectory, life {own['life']:.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=REPO, help="source tree to run (a git worktree of a commit)")
    parser.add_argument("--prompts", type=int, default=8000)
    parser.add_argument("--n", type=int, default=1, help="actor_rollout_ref.rollout.n")
    parser.add_argument("--example", choices=("single", "tool"), default="single")
    parser.add_argument("--smoke", action="store_true", help="seconds: genrun's checks of the command, the sampler")
    parser.add_argument("override", nargs="*", help="more genrun overrides")
    args = parser.parse_args()
    if args.smoke:
        return smoke(args)
    args.tree = args.tree.resolve()
    report(run_once(args), engine_seconds_per_call(args.tree))


if __name__ == "__main__":
    main()
