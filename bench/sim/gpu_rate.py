"""genrun at a GPU's rate, without a GPU (issue 46 item 2): what share of an engine's capacity
survives the pipeline, and how many shard workers per replica that takes.

    .venv/bin/python bench/sim/gpu_rate.py [--tokens-per-second 40000] [--token-latency 0.01]
        [--tokens 128] [--n 4] [--prompts 2400] [--workers 1,2,4,8] [key=value ...]

The stand-in: bench/sim's engine at time_scale 1, `--tokens-per-second x --token-latency` slots,
a decode step every `--token-latency` s, every answer `--tokens` long, served like every engine.
Per worker count (generation.num_shards, until one keeps 0.95) one run through genrun's CLI
(bench/sim/genrun.py), n=`--n`, log-probs on. The kept share, steady (trajectories/s between the
10th and 90th percentile of finishes, over the stand-in's full-batch rate; it decides the search)
and over the whole generation phase (over the stand-in alone on the same requests); per role of
the run's processes (bench/process_roles.py), cores used / main threads running or waiting for a
core (near 1 per process: that role saturated). `--smoke`: the stand-in alone and genrun's checks.
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

from bench.genrun_process import check_command, genrun_env, write_prompts  # noqa: E402
from bench.process_roles import follow  # noqa: E402
from bench.sim.engine import SimulatedEngine, SimulatedSettings, VirtualClockLoop  # noqa: E402
from generation_core.instrumentation import SAMPLE_TRACE_ENV, generation_phase, read_timeline  # noqa: E402

TARGET = 0.95  # the steady share of the stand-in's capacity that ends the search
PROMPT_TOKENS = 24  # about what the prompts below become with the bundled model's chat template


def standin_slots(args: argparse.Namespace) -> int:
    return max(1, round(args.tokens_per_second * args.token_latency))


def standin_settings(args: argparse.Namespace) -> dict[str, float]:
    """The stand-in's `engine_kwargs.simulated`: fixed lengths, no prefill cost, on the wall clock."""
    return {
        "decode_seconds_per_step": args.token_latency,
        "prefill_seconds_per_token": 0.0,
        "response_tokens_median": args.tokens,
        "response_tokens_sigma": 0.0,
        "time_scale": 1.0,
    }


def standin_overrides(args: argparse.Namespace) -> list[str]:
    rollout = "actor_rollout_ref.rollout"
    return [
        f"{rollout}.name=simulated",
        f"{rollout}.max_num_seqs={standin_slots(args)}",
        f"{rollout}.n={args.n}",
        f"{rollout}.calculate_log_probs=true",
        f"data.max_response_length={args.tokens}",
        "trainer.n_gpus_per_node=1",
    ] + [f"+{rollout}.engine_kwargs.simulated.{key}={value}" for key, value in standin_settings(args).items()]


def alone(args: argparse.Namespace, requests: int, *, wall_clock: bool = False) -> tuple[int, float, float]:
    """The stand-in by itself: `requests` sent at once -> (tokens, seconds, seconds it lost to
    steps that started late). On the virtual clock unless `wall_clock` (then its own Python counts)."""
    lengths = dict(prompt_length=1024, response_length=args.tokens, eos_token_id=2)
    settings = SimulatedSettings(**lengths, max_num_seqs=standin_slots(args), **standin_settings(args))
    engine = SimulatedEngine(settings)
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


def run_once(args: argparse.Namespace, workers: int, prompts: Path, scratch: Path) -> dict:
    folder, timeline, trace, log = (scratch / f"workers-{workers}{end}" for end in ("", ".timeline", ".trace", ".log"))
    command = [sys.executable, "-m", "bench.sim.genrun", *standin_overrides(args), f"data.train_files={prompts}"]
    command += [f"trainer.default_local_dir={folder}", f"generation.num_shards={workers}"]
    command += [f"ray_kwargs.ray_init.num_cpus={workers + 2}", "generation.show_progress=false", *args.overrides]
    started = time.time()
    with log.open("w") as out:
        env = dict(genrun_env(timeline), **{SAMPLE_TRACE_ENV: str(trace)})
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        processes = follow(process, 0.5)
    if process.returncode != 0:
        sys.exit(f"the run with {workers} worker(s) failed (exit {process.returncode}); its log: {log}")
    phase_start, phase_end = generation_phase(read_timeline(timeline))
    phase = phase_end - phase_start
    roles = processes.roles(phase_start, phase_end)
    busiest = sorted((role for role in roles if roles[role]["phase"] > 0), key=lambda role: -roles[role]["phase"])
    return {
        "workers": workers,
        "tokens": int(json.loads((folder / "manifest.json").read_text())["generated_tokens"]),
        "phase_seconds": round(phase, 2),
        "steady_trajectories_per_second": round(steady_rate(trace), 1),
        "wall_seconds": round(time.time() - started, 1),
        "cores": {
            role: f"{roles[role]['phase'] / phase:.2f}/{roles[role]['runnable'] / phase:.2f}" for role in busiest
        },
    }


def steady_rate(trace: Path) -> float:
    """Trajectories per second between the 10th and the 90th percentile of their finish times."""
    finished = sorted(float(line.split()[0]) for line in trace.read_text().splitlines())
    first, last = len(finished) // 10, len(finished) * 9 // 10
    return (last - first) / (finished[last] - finished[first])


def smoke(args: argparse.Namespace) -> None:
    from bench.sim import register
    from bench.sim.replica import simulated_kwargs
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
        cfg = check_command(arguments)
        check_rollout_name(cfg)
        simulated_kwargs(cfg.actor_rollout_ref.rollout.engine_kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-second", type=float, default=40000.0, help="the stand-in's rate per replica")
    parser.add_argument("--token-latency", type=float, default=0.01, help="seconds per token of each sequence")
    parser.add_argument("--tokens", type=int, default=128, help="every answer's length")
    parser.add_argument("--n", type=int, default=4, help="rollout.n")
    parser.add_argument("--prompts", type=int, default=2400, help="prompts per run (x n requests)")
    parser.add_argument("--workers", type=lambda text: [int(w) for w in text.split(",")], default=[1, 2, 4, 8])
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
    rows = []
    with tempfile.TemporaryDirectory(prefix="genrun-gpu-rate-", ignore_cleanup_errors=True) as scratch:
        write_prompts(Path(scratch) / "prompts.parquet", args.prompts)
        for workers in args.workers:
            row = run_once(args, workers, Path(scratch) / "prompts.parquet", Path(scratch))
            rate = row["tokens"] / row["phase_seconds"]
            row.update(tokens_per_second=round(rate), trajectories_per_second=round(rate / args.tokens, 1))
            row["kept_phase"] = round(rate / capacity, 3)
            row["kept_steady"] = round(row["steady_trajectories_per_second"] * args.tokens / args.tokens_per_second, 3)
            rows.append(row)
            print(
                f"  {workers} shard worker(s): steady {row['steady_trajectories_per_second']} trajectories/s, kept "
                f"{row['kept_steady']}; whole phase {row['trajectories_per_second']} trajectories/s ({rate:.0f} "
                f"tokens/s over {row['phase_seconds']} s, {row['wall_seconds']} s whole command), kept "
                f"{row['kept_phase']}; cores busy/runnable: {', '.join(f'{r} {c}' for r, c in row['cores'].items())}",
                flush=True,
            )
            if row["kept_steady"] >= TARGET:
                break
    best = max(rows, key=lambda r: r["kept_steady"])
    print(
        f"steady kept >= {TARGET} with {best['workers']} shard worker(s) per replica"
        if best["kept_steady"] >= TARGET
        else f"no worker count tried kept {TARGET} steady (best: {best['kept_steady']} with {best['workers']})"
    )


if __name__ == "__main__":
    main()
