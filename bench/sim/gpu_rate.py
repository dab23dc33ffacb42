"""genrun at a GPU's rate, without a GPU (issue 46 item 2): what share of an engine's capacity
survives the pipeline, and how many shard workers per replica that takes.

    .venv/bin/python bench/sim/gpu_rate.py [--tokens-per-second 40000] [--token-latency 0.01]
        [--tokens 128] [--n 4] [--prompts 2400] [--workers 1,2,4,8] [--target 0.95] [key=value ...]
    .venv/bin/python bench/sim/gpu_rate.py --smoke

The stand-in is bench/sim's simulated engine at time_scale 1: `--tokens-per-second x
--token-latency` slots (`max_num_seqs`), one decode step of the whole batch every
`--token-latency` seconds, every answer `--tokens` long, no prefill cost, log-probs when asked
for: at 40,000 tokens/s and 128-token answers about 310 trajectories/s from one replica, as
SGLang gives on an H100 (issue 46). It is served like every engine: one EngineServer actor per
replica, genrun's routing client in each shard worker, TokenOutput back through Ray.

For each `--workers` count (generation.num_shards on one replica, in order, until one keeps
`--target`), one whole run through genrun's CLI (bench/sim/genrun.py: the CLI with the simulator
registered; its own temporary Prefect server and local Ray with enough CPUs for the workers):
rollout.n=`--n`, calculate_log_probs=true. Two figures, each a share of the stand-in's:
  - steady (what decides the search): trajectories finished per second between the run's 10th
    and 90th percentile of finish times (GENRUN_SAMPLE_TRACE), against the stand-in's rate with
    its batch full: what a long run keeps once every worker is going;
  - whole phase: genrun's tokens over its generation phase (first shard worker ready -> last shard
    done, the run's timeline) against the stand-in alone on the same requests sent at once (on a
    virtual clock: its own drain included, as an engine's offline benchmark has it); a short run's
    start and end weigh on it.
Beside them, per role of the run's processes during the phase (driver, shard workers, server
actor): the cores its processes used, and the share of the time their event loop threads were
running or waiting for a core (RoleCpu): near 1 per process, that role is the one that saturated
(on a loaded machine it may use far less than a core and still be the bottleneck).

`--smoke` (seconds): the stand-in alone, on the virtual clock and for a moment on the wall clock,
and genrun's input checks of the command a run would use; no run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.sim.engine import SimulatedEngine, SimulatedSettings, VirtualClockLoop  # noqa: E402

PROMPT_TOKENS = 24  # about what the prompts below become with the bundled model's chat template


def standin_slots(args: argparse.Namespace) -> int:
    return max(1, round(args.tokens_per_second * args.token_latency))


def standin_overrides(args: argparse.Namespace) -> list[str]:
    kwargs = "+actor_rollout_ref.rollout.engine_kwargs.simulated"
    return [
        "actor_rollout_ref.rollout.name=simulated",
        f"actor_rollout_ref.rollout.max_num_seqs={standin_slots(args)}",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"data.max_response_length={args.tokens}",
        "trainer.n_gpus_per_node=1",
        f"{kwargs}.decode_seconds_per_step={args.token_latency}",
        f"{kwargs}.prefill_seconds_per_token=0.0",
        f"{kwargs}.response_tokens_median={args.tokens}",
        f"{kwargs}.response_tokens_sigma=0.0",
        f"{kwargs}.time_scale=1.0",
    ]


def alone(args: argparse.Namespace, requests: int, *, wall_clock: bool = False) -> tuple[int, float, float]:
    """The stand-in by itself: `requests` sent at once -> (tokens, seconds, seconds it lost to
    steps that started late). On the virtual clock unless `wall_clock` (then its own Python counts)."""
    engine = SimulatedEngine(
        SimulatedSettings(
            prompt_length=1024,
            response_length=args.tokens,
            eos_token_id=2,
            max_num_seqs=standin_slots(args),
            decode_seconds_per_step=args.token_latency,
            prefill_seconds_per_token=0.0,
            response_tokens_median=args.tokens,
        )
    )
    params = {"temperature": 1.0, "logprobs": True}

    async def all_at_once() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        answers = await asyncio.gather(
            *(
                engine.generate(str(i), prompt_ids=[100 + i % 900] * PROMPT_TOKENS, sampling_params=params)
                for i in range(requests)
            )
        )
        assert all(len(a.log_probs or ()) == len(a.token_ids) for a in answers), "log-probs for every token"
        return sum(len(a.token_ids) for a in answers), loop.time() - started

    loop = asyncio.new_event_loop() if wall_clock else VirtualClockLoop()
    try:
        tokens, seconds = loop.run_until_complete(all_at_once())
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    return tokens, seconds, engine.stats["late_seconds"]


def write_prompts(path: Path, count: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "bench",
            "prompt": [{"role": "user", "content": f"Question number {i}?"}],
            "extra_info": {"index": i},
        }
        for i in range(count)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


# ---- the CPU each role of the run's processes used -------------------------------------------

ROLES = {"run_shard": "shard workers", "EngineServer": "server actor"}


def _role(process, root: int) -> str:
    if process.pid == root:
        return "driver"
    title = " ".join(process.cmdline())
    if title.startswith("ray::"):
        # `ray::Class.method` or `ray::name:Class.method`; an idle worker is `ray::IDLE`.
        name = title[5:].split()[0].split(":")[-1].split(".")[0]
        return ROLES.get(name, "other ray workers")
    return "other processes"


class RoleCpu:
    """Polls every process below `root`; each poll's increase goes to the role the process's title
    names at that poll (a Ray worker's title follows the task it runs). Two figures per role:
    CPU (all its threads), and how much of the time its main thread (the event loop) was running
    or ready to run but waiting for a core (/proc/PID/schedstat): near 1 per process, it had all
    it could take, on a machine where others took cores from it."""

    def __init__(self, root: int):
        import psutil

        self.root = psutil.Process(root)
        self.last: dict[tuple[int, float], tuple[float, float]] = {}
        self.deltas: list[tuple[float, str, float, float]] = []

    def poll(self) -> None:
        import psutil

        now = time.time()
        try:
            processes = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in processes:
            try:
                with process.oneshot():
                    key = (process.pid, process.create_time())
                    times = process.cpu_times()
                    role = _role(process, self.root.pid)
                with open(f"/proc/{process.pid}/schedstat") as handle:
                    on_cpu, waiting = (int(field) / 1e9 for field in handle.read().split()[:2])
            except (OSError, psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            now_values = (times.user + times.system, on_cpu + waiting)
            before = self.last.get(key, now_values)
            self.deltas.append((now, role, now_values[0] - before[0], now_values[1] - before[1]))
            self.last[key] = now_values

    def cores(self, start: float, end: float) -> dict[str, str]:
        """role -> "CPU cores busy / main threads runnable", averaged between `start` and `end`."""
        used: dict[str, list[float]] = {}
        for moment, role, cpu, runnable in self.deltas:
            if start < moment <= end:
                row = used.setdefault(role, [0.0, 0.0])
                row[0] += cpu
                row[1] += runnable
        seconds = end - start
        return {
            role: f"{cpu / seconds:.2f}/{runnable / seconds:.2f}"
            for role, (cpu, runnable) in sorted(used.items(), key=lambda kv: -kv[1][0])
        }


# ---- one run ---------------------------------------------------------------------------------


def run_once(args: argparse.Namespace, workers: int, prompts: Path, scratch: Path) -> dict:
    from bench.genrun_process import genrun_env
    from generation_core.instrumentation import SAMPLE_TRACE_ENV, generation_phase_seconds, read_timeline

    folder, timeline, trace, log = (
        scratch / f"workers-{workers}{suffix}" for suffix in ("", ".timeline", ".trace", ".log")
    )
    command = [
        sys.executable,
        "-m",
        "bench.sim.genrun",
        *standin_overrides(args),
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={folder}",
        f"generation.num_shards={workers}",
        f"ray_kwargs.ray_init.num_cpus={workers + 2}",
        "generation.show_progress=false",
        *args.overrides,
    ]
    started = time.time()
    with log.open("w") as out:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=dict(genrun_env(timeline), **{SAMPLE_TRACE_ENV: str(trace)}),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        cpu = RoleCpu(process.pid)
        while process.poll() is None:
            cpu.poll()
            time.sleep(args.poll)
    wall = time.time() - started
    if process.returncode != 0:
        sys.exit(f"the run with {workers} worker(s) failed (exit {process.returncode}); its log: {log}")
    events = read_timeline(timeline)
    phase = generation_phase_seconds(events)
    manifest = json.loads((folder / "manifest.json").read_text())
    return {
        "workers": workers,
        "tokens": int(manifest["generated_tokens"]),
        "phase_seconds": round(phase, 2),
        "steady_trajectories_per_second": round(steady_rate(trace), 1),
        "wall_seconds": round(wall, 1),
        "cores": cpu.cores(max(events["shard_done"]) - phase, max(events["shard_done"])),
    }


def steady_rate(trace: Path) -> float:
    """Trajectories per second between the 10th and the 90th percentile of their finish times."""
    finished = sorted(float(line.split()[0]) for line in trace.read_text().splitlines())
    first, last = len(finished) // 10, len(finished) * 9 // 10
    return (last - first) / (finished[last] - finished[first])


# ---- the command -----------------------------------------------------------------------------


def smoke(args: argparse.Namespace) -> None:
    """Seconds: the stand-in alone (virtual and wall clock) at a small rate, and genrun's input
    checks of the command a run would use; no run."""
    from bench.genrun_process import check_command
    from bench.sim import register
    from bench.sim.replica import simulated_kwargs
    from generation_core.config.loading import load_config
    from generation_core.serving.pool import check_rollout_name

    small = argparse.Namespace(**dict(vars(args), tokens_per_second=2000.0, token_latency=0.01, tokens=16))
    tokens, seconds, _ = alone(small, 40)
    assert tokens == 40 * 16 and abs(tokens / seconds - 2000.0) < 1e-6, (tokens, seconds)
    print(f"smoke: the stand-in alone, virtual clock: {tokens / seconds:.0f} tokens/s ({tokens} tokens)")
    tokens, seconds, late = alone(small, 40, wall_clock=True)
    print(f"smoke: the stand-in alone, wall clock: {tokens / seconds:.0f} tokens/s, {late:.3f} s late")
    register()
    with tempfile.TemporaryDirectory(prefix="genrun-gpu-rate-smoke-") as scratch:
        prompts = Path(scratch) / "prompts.parquet"
        write_prompts(prompts, 8)
        arguments = [*standin_overrides(args), f"data.train_files={prompts}", *args.overrides]
        check_command(arguments)
        cfg = load_config(arguments)
        check_rollout_name(cfg)
        simulated_kwargs(cfg.actor_rollout_ref.rollout.engine_kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-second", type=float, default=40000.0, help="the stand-in's rate per replica")
    parser.add_argument("--token-latency", type=float, default=0.01, help="seconds per token of each sequence")
    parser.add_argument("--tokens", type=int, default=128, help="every answer's length")
    parser.add_argument("--n", type=int, default=4, help="rollout.n")
    parser.add_argument("--prompts", type=int, default=2400, help="prompts per run (x n requests)")
    parser.add_argument(
        "--workers", type=lambda text: [int(w) for w in text.split(",")], default=[1, 2, 4, 8], help="e.g. 1,2,4,8"
    )
    parser.add_argument("--target", type=float, default=0.95, help="the kept share that ends the search")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between CPU polls")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders and logs")
    parser.add_argument("--smoke", action="store_true", help="seconds: the stand-in alone and genrun's input checks")
    args, args.overrides = parser.parse_known_args()
    if args.smoke:
        return smoke(args)
    requests = args.prompts * args.n
    alone_tokens, alone_seconds, _ = alone(args, requests)
    capacity = alone_tokens / alone_seconds
    print(
        f"stand-in: {args.tokens_per_second:.0f} tokens/s per replica ({standin_slots(args)} slots x "
        f"{args.token_latency} s per token), {args.tokens}-token answers; alone on {requests} requests "
        f"({args.prompts} prompts x n={args.n}): {capacity:.0f} tokens/s, {capacity / args.tokens:.0f} trajectories/s",
        flush=True,
    )
    scratch = Path(tempfile.mkdtemp(prefix="genrun-gpu-rate-"))
    prompts = scratch / "prompts.parquet"
    write_prompts(prompts, args.prompts)
    rows, took = [], None
    for workers in args.workers:
        row = run_once(args, workers, prompts, scratch)
        rate = row["tokens"] / row["phase_seconds"]
        row.update(tokens_per_second=round(rate), trajectories_per_second=round(rate / args.tokens, 1))
        row["kept_phase"] = round(rate / capacity, 3)
        row["kept_steady"] = round(row["steady_trajectories_per_second"] * args.tokens / args.tokens_per_second, 3)
        rows.append(row)
        print(
            f"  {workers} shard worker(s): steady {row['steady_trajectories_per_second']} trajectories/s, kept "
            f"{row['kept_steady']}; whole phase {row['trajectories_per_second']} trajectories/s ({rate:.0f} tokens/s "
            f"over {row['phase_seconds']} s, {row['wall_seconds']} s whole command), kept {row['kept_phase']}; "
            f"cores busy/runnable: {', '.join(f'{r} {c}' for r, c in row['cores'].items())}",
            flush=True,
        )
        if row["kept_steady"] >= args.target:
            took = workers
            break
    best = max(rows, key=lambda r: r["kept_steady"])
    print(
        f"steady kept >= {args.target} with {took} shard worker(s) per replica"
        if took
        else f"no worker count tried kept {args.target} steady (best: {best['kept_steady']} with {best['workers']})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"arguments": vars(args), "capacity_tokens_per_second": capacity, "runs": rows}, indent=1)
        )
    if not args.keep:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    else:
        print(f"kept: {scratch}")


if __name__ == "__main__":
    main()
