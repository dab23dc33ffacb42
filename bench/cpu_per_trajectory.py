"""CPU time per trajectory of a whole `genrun` run, per process role (issue 46 item 1).

    .venv/bin/python bench/cpu_per_trajectory.py [--tree DIR] [--prompts 8000] [--n 1] [--example single|tool]
    .venv/bin/python bench/cpu_per_trajectory.py --smoke

Runs the CLI the way a user does (`genrun`, instant engine, one shard, parts of `--part-size`,
its own temporary Prefect server and local Ray) on the source tree `--tree` (default: this
checkout; an old commit: `git worktree add /tmp/wt-SHA SHA` and `--tree /tmp/wt-SHA`, run with
this venv), and reads every descendant process's CPU time (utime + stime of /proc/PID/stat)
every `--poll` seconds until the run and everything it started are gone, keeping the last value
per (pid, start time). CPU time is much less sensitive to other work on the machine than
wall-clock throughput, which is printed too, as a secondary figure.

Processes are grouped by role: the driver (genrun itself), the Ray workers by the class or
function their process title names (`ray::run_shard` = the shard worker, `ray::EngineServer` =
the server actor, `ray::ServerRegistry`, `ray::ProgressBoard`), Ray's daemons, the Prefect
server and the watchdog. For each role two figures, in CPU microseconds per trajectory:
  - generation phase: CPU spent between the timeline's generation start (the first shard worker
    ready, the engine up) and the last shard done, interpolated between polls: the steady cost
    that bounds one shard's throughput;
  - whole run: CPU over each process's life (start-up, Ray, Prefect, merge and zip included).
"genrun's own" sums the driver, the shard worker, the registry, the progress board and the
server actor less the engine's compute (the instant engine's `generate` timed in process).

`--smoke` (seconds) runs genrun's own input checks on the command instead of the run, and the
sampler over a small process tree of known CPU.

`--profile ROLE` attaches py-spy (`--rate`, raw collapsed stacks, idle frames off) to the first
process of that role and writes its profile to `--profile-out`.
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
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = REPO / ".venv" / "bin"
TICKS = os.sysconf("SC_CLK_TCK")

# Ray's process titles (`ray::Name` or `ray::Name.method`) -> role.
RAY_ROLES = {
    "run_shard": "shard worker",
    "EngineServer": "server actor",
    "ServerRegistry": "server registry",
    "ProgressBoard": "progress board",
    "DashboardAgent": "ray daemons",
    "RuntimeEnvAgent": "ray daemons",
    "IDLE": "idle ray workers",
}
OWN_ROLES = ("driver", "shard worker", "server registry", "progress board", "server actor")
DAEMON_MARKS = ("gcs_server", "raylet", "dashboard.py", "monitor.py", "log_monitor.py", "ray/_private", "ray/dashboard")


@dataclass
class Process:
    pid: int
    titles: list[str] = field(default_factory=list)
    samples: list[tuple[float, float]] = field(default_factory=list)
    """(unix time, CPU seconds so far)."""

    def cpu_at(self, moment: float) -> float:
        """CPU seconds at `moment`, linear between polls (0 before the first, the last after the last)."""
        if not self.samples or moment <= self.samples[0][0]:
            return 0.0 if not self.samples or moment < self.samples[0][0] else self.samples[0][1]
        for (t0, c0), (t1, c1) in zip(self.samples, self.samples[1:], strict=False):
            if moment <= t1:
                return c0 + (c1 - c0) * (moment - t0) / (t1 - t0)
        return self.samples[-1][1]


def read_stat(pid: int) -> tuple[int, int, float] | None:
    """(ppid, start time in ticks, CPU seconds) of a live or zombie process, or None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid = field 4, utime 14, stime 15, starttime 22.
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / TICKS


def read_title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def role_of(pid: int, root: int, titles: list[str]) -> str:
    if pid == root:
        return "driver"
    # `ray::Class.method`, or `ray::actor_name:Class.method` for a named actor.
    names = [t[5:].split()[0].split(":")[-1].split(".")[0] for t in titles if t.startswith("ray::")]
    busy = [name for name in names if name != "IDLE"]
    if busy or names:
        name = (busy or names)[0]
        return RAY_ROLES.get(name, f"ray::{name}")
    joined = " ".join(titles)
    if "prefect.server" in joined or "prefect" in joined and "uvicorn" in joined:
        return "prefect server"
    if "watchdog" in joined:
        return "watchdog"
    if any(mark in joined for mark in DAEMON_MARKS):
        return "ray daemons"
    return f"other: {Path(joined.split()[0]).name if joined else '?'}"


class Sampler:
    """Polls /proc for the CPU time of every process below `root` (and those once below it)."""

    def __init__(self, root: int):
        self.root = root
        self.processes: dict[tuple[int, int], Process] = {}
        self.exited_at: float | None = None
        """When the root process exited (follow)."""

    def poll(self, now: float) -> int:
        """One look at /proc; the number of tracked processes still alive."""
        table = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = read_stat(int(entry))
                if stat is not None:
                    table[int(entry)] = stat
        tracked = {pid for pid, start in self.processes if table.get(pid, (0, -1))[1] == start}
        tracked.add(self.root)
        grew = True
        while grew:
            below = {pid for pid, (ppid, _, _) in table.items() if ppid in tracked and pid not in tracked}
            tracked |= below
            grew = bool(below)
        alive = 0
        for pid in tracked:
            if pid not in table:
                continue
            _, start, cpu = table[pid]
            process = self.processes.setdefault((pid, start), Process(pid))
            title = read_title(pid)
            if title and (not process.titles or process.titles[-1] != title):
                process.titles.append(title)
            process.samples.append((now, cpu))
            alive += 1
        return alive

    def first_of_role(self, role: str) -> int | None:
        for process in self.processes.values():
            if role_of(process.pid, self.root, process.titles) == role and process.samples:
                return process.pid
        return None

    def roles(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """role -> {'processes', 'phase' CPU seconds in [start, end], 'life' CPU seconds}."""
        out: dict[str, dict[str, float]] = {}
        for process in self.processes.values():
            role = role_of(process.pid, self.root, process.titles)
            row = out.setdefault(role, {"processes": 0, "phase": 0.0, "life": 0.0})
            row["processes"] += 1
            row["phase"] += process.cpu_at(end) - process.cpu_at(start)
            row["life"] += process.samples[-1][1] if process.samples else 0.0
        return out


def write_prompts(path: Path, count: int, example: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if example == "tool":
        source = pq.read_table(REPO / "examples" / "tool_calling" / "data" / "arithmetic.parquet").to_pylist()
        rows = []
        for i in range(count):
            row = dict(source[i % len(source)])
            row["extra_info"] = {**(row.get("extra_info") or {}), "index": i}
            rows.append(row)
    else:
        rows = [
            {
                "data_source": "bench",
                "prompt": [{"role": "user", "content": f"Question number {i}?"}],
                "extra_info": {"index": i},
            }
            for i in range(count)
        ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def genrun_arguments(args: argparse.Namespace, prompts: Path, out: Path) -> list[str]:
    arguments = [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        "generation.show_progress=false",
        f"generation.save_batch_size={args.part_size}",
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
    done = subprocess.run(
        [str(VENV_BIN / "python"), "-c", _ENGINE_COST, str(calls)],
        env=dict(os.environ, PYTHONPATH=str(tree)),
        cwd=str(tree),
        capture_output=True,
        text=True,
    )
    return float(done.stdout.strip()) if done.returncode == 0 else None


def start_profiler(pid: int, args: argparse.Namespace) -> subprocess.Popen:
    return subprocess.Popen(
        [str(VENV_BIN / "py-spy"), "record", "--rate", str(args.rate), "--pid", str(pid), "--format", "raw"]
        + ["--output", str(args.profile_out), "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def follow(child: subprocess.Popen, poll: float, profile: tuple[str, argparse.Namespace] | None = None) -> Sampler:
    """Sample `child` and every process below it until all are gone (or 30 s after `child`
    exited); `profile`: (role, args) to start py-spy on the first process of that role."""
    sampler = Sampler(child.pid)
    profiler, exited_at = None, None
    while True:
        now = time.time()
        # Not reaped yet (WNOWAIT): a zombie's /proc stat still holds its final CPU time.
        exited = exited_at is None and os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        alive = sampler.poll(now)
        if profile is not None and profiler is None:
            pid = sampler.first_of_role(profile[0])
            if pid is not None:
                profiler = start_profiler(pid, profile[1])
        if exited:
            exited_at = now
            child.wait()
        if exited_at is not None and (alive == 0 or now - exited_at > 30):
            break
        time.sleep(poll)
    sampler.exited_at = exited_at
    if profiler is not None:
        profiler.wait(timeout=60)
    return sampler


def run_once(args: argparse.Namespace) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="genrun-cpu-"))
    try:
        prompts, out, timeline = scratch / "prompts.parquet", scratch / "run", scratch / "timeline.txt"
        write_prompts(prompts, args.prompts, args.example)
        env = dict(os.environ, PYTHONPATH=str(args.tree), GENRUN_TIMELINE=str(timeline))
        env.pop("PREFECT_API_URL", None)
        command = [str(VENV_BIN / "python"), str(VENV_BIN / "genrun"), *genrun_arguments(args, prompts, out)]
        started = time.time()
        with open(scratch / "stderr", "w") as stderr:
            child = subprocess.Popen(command, cwd=str(args.tree), env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            sampler = follow(child, args.poll, (args.profile, args) if args.profile else None)
        if child.returncode != 0:
            raise SystemExit(f"genrun failed ({child.returncode}):\n{(scratch / 'stderr').read_text()[-3000:]}")
        events: dict[str, list[float]] = {}
        for line in timeline.read_text().splitlines():
            events.setdefault(line.split()[0], []).append(float(line.split()[-1]))
        phase_start = min(events["shard_worker_ready"])
        if "engine_ready" in events:
            phase_start = max(events["engine_ready"][0], phase_start)
        phase_end = max(events["shard_done"])
        trajectories = json.loads((out / "manifest.json").read_text())["num_trajectories"]
        return {
            "tree": str(args.tree),
            "trajectories": trajectories,
            # The instant engine never writes a tool call: every trajectory (the tool example's too) is one request.
            "requests": trajectories,
            "phase_seconds": phase_end - phase_start,
            "command_seconds": sampler.exited_at - started,
            "roles": sampler.roles(phase_start, phase_end),
        }
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(f"kept {scratch}", file=sys.stderr)


# --smoke: a parent and a child that burn a known amount of CPU, followed as a run is.
_BURN = "import sys, time\nend = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\n"
_SMOKE_TREE = _BURN + "import subprocess\nsubprocess.run([sys.executable, '-c', __doc__, '0.3'])\n"


def smoke(args: argparse.Namespace) -> None:
    """Seconds, not a run (Prefect and Ray take a minute to start): genrun's own input checks of
    the command this bench runs, and the sampler over a small process tree of known CPU."""
    from genrun_process import check_command

    scratch = Path(tempfile.mkdtemp(prefix="genrun-cpu-smoke-"))
    try:
        write_prompts(scratch / "prompts.parquet", 300, args.example)
        check_command(genrun_arguments(args, scratch / "prompts.parquet", scratch / "run"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tree = f"__doc__ = {_BURN!r}\n{_SMOKE_TREE}"
    sampler = follow(subprocess.Popen([sys.executable, "-c", tree, "0.2"]), 0.05)
    roles = sampler.roles(0.0, time.time())
    cpu = sum(row["life"] for row in roles.values())
    print(f"smoke: {len(sampler.processes)} processes followed, {cpu:.2f} CPU-s (about 0.5 burnt): {roles}")
    assert len(sampler.processes) == 2 and 0.3 <= cpu <= 1.5, roles


def report(result: dict, engine_call: float | None) -> None:
    count = result["trajectories"]
    roles = result["roles"]
    print(
        f"tree {result['tree']}: {count} trajectories; generation phase {result['phase_seconds']:.2f} s = "
        f"{count / result['phase_seconds']:.0f} trajectories/s, whole command {result['command_seconds']:.1f} s "
        "(wall clock: measured under whatever load the machine had)"
    )
    print(f"  {'role':22s} {'procs':>5s} {'phase us/traj':>14s} {'life us/traj':>13s}")
    for role in sorted(roles, key=lambda r: -roles[r]["life"]):
        row = roles[role]
        print(
            f"  {role:22s} {row['processes']:5d} {row['phase'] / count * 1e6:14.0f} {row['life'] / count * 1e6:13.0f}"
        )
    phase = sum(r["phase"] for r in roles.values())
    life = sum(r["life"] for r in roles.values())
    print(f"  {'all processes':22s} {'':5s} {phase / count * 1e6:14.0f} {life / count * 1e6:13.0f}")
    own_phase = sum(roles[r]["phase"] for r in OWN_ROLES if r in roles)
    own_life = sum(roles[r]["life"] for r in OWN_ROLES if r in roles)
    engine = (engine_call or 0.0) * result["requests"]
    print(
        f"  genrun's own (driver, shard worker, registry, progress board, server actor less the engine's compute"
        f" {engine_call * 1e6 if engine_call else float('nan'):.1f} us/request): "
        f"phase {(own_phase - engine) / count * 1e6:.0f} us/trajectory, life {(own_life - engine) / count * 1e6:.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=REPO, help="source tree to run (a git worktree of a commit)")
    parser.add_argument("--prompts", type=int, default=8000)
    parser.add_argument("--n", type=int, default=1, help="actor_rollout_ref.rollout.n")
    parser.add_argument("--example", choices=("single", "tool"), default="single")
    parser.add_argument("--part-size", type=int, default=1000, help="generation.save_batch_size")
    parser.add_argument("--poll", type=float, default=0.2, help="seconds between looks at /proc")
    parser.add_argument(
        "--smoke", action="store_true", help="seconds: genrun's checks of the command, the sampler on a small tree"
    )
    parser.add_argument("--profile", help="a role to profile with py-spy (e.g. 'shard worker')")
    parser.add_argument("--profile-out", type=Path, default=Path("profile.txt"))
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (run, timeline, stderr)")
    parser.add_argument("override", nargs="*", help="more genrun overrides")
    args = parser.parse_args()
    if args.smoke:
        smoke(args)
        return
    args.tree = args.tree.resolve()
    result = run_once(args)
    engine_call = engine_seconds_per_call(args.tree)
    report(result, engine_call)
    if args.json:
        args.json.write_text(json.dumps({**result, "engine_seconds_per_call": engine_call}, indent=1))


if __name__ == "__main__":
    main()
