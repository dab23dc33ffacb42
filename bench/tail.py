"""The end of a run on the simulated engine: each shard keeping its own max_inflight against the
run's in-flight budget shared by the shards still running (issue 34, item 5), side by side on
the same samples.

    .venv/bin/python bench/tail.py [--workers 16] [--shards 64] [--replicas 4] [--n 8] [--sigma 1.0]

The longest-first ordering this bench once measured (`generation.longest_first_from`, removed):
its figures are in bench/RESULTS.md's history and docs/scale.md.

Shard workers pull shards from one queue (as Prefect hands shard tasks to Ray workers: more
shards than workers), each shard's samples sent through genrun's `RoutingClient` (prefix-affinity
routing, the default) with genrun's `CallSlots` bounding its model calls. Every simulated second
each running shard reports to genrun's `ProgressBoard` (the Ray actor, called here in-process)
and its slots follow the share it answers, capped by `--cap` (generation.inflight_share_cap);
`--cap 1` is every shard on its own max_inflight, what genrun did before. Shard sizes are drawn
from a lognormal (`--shard-sigma`), response lengths too (`--sigma`); the replicas are
bench/sim/engine.py's (max_num_seqs slots, a decode step per token, prefill per uncached prompt
token), on a simulated clock: figures are simulated seconds, the same on any machine.

Printed per row: simulated seconds to the last trajectory, trajectories/s, the tail (the share of
the run's time its last 1% of trajectories take: from the 99th-percentile finish to the last), the
replicas' busy-slot fraction over the run and over its last 20%, and the most calls one shard had
in flight; then after/before ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scheduling import SimulatedBackend, _Source  # noqa: E402
from bench.sim.engine import SimulatedEngine, SimulatedSettings, VirtualClockLoop  # noqa: E402
from generation_core.serving.replica_loads import ReplicaChooser  # noqa: E402
from generation_core.serving.routing import RoutingClient  # noqa: E402
from generation_core.shard.call_slots import CallSlots  # noqa: E402
from generation_core.shard.progress_board import ProgressBoard  # noqa: E402

REPORT_SECONDS = 1.0
SAMPLE_SECONDS = 0.1


@dataclass
class Scenario:
    name: str
    workers: int = 16
    shards: int = 64
    mean_prompts: int = 8
    shard_sigma: float = 0.8
    replicas: int = 4
    n: int = 8
    max_inflight: int = 64
    max_num_seqs: int = 32
    prompt_tokens: int = 512
    median: int = 64
    sigma: float = 1.0
    response_length: int = 1024
    seed: int = 0


def shard_sizes(s: Scenario) -> list[int]:
    """Prompts per shard: lognormal around the mean, at least one."""
    rng = random.Random(s.seed)
    raw = [rng.lognormvariate(0.0, s.shard_sigma) for _ in range(s.shards)]
    scale = s.mean_prompts * s.shards / sum(raw)
    return [max(1, round(r * scale)) for r in raw]


async def _run(s: Scenario, cap: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    engines = [
        SimulatedEngine(
            SimulatedSettings(
                prompt_length=s.prompt_tokens,
                response_length=s.response_length,
                eos_token_id=2,
                max_num_seqs=s.max_num_seqs,
                vocab_size=50_000,
                decode_seconds_per_step=0.02,
                prefill_seconds_per_token=0.0001,
                prefix_cache_tokens=65_536,
                response_tokens_median=s.median,
                response_tokens_sigma=s.sigma,
                seed=s.seed + r,
            )
        )
        for r in range(s.replicas)
    ]
    backends = {f"replica-{r}": SimulatedBackend(e) for r, e in enumerate(engines)}
    config = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"name": "simulated"}}, "generation": {"routing": "prefix_affinity"}}
    )
    rng = random.Random(s.seed)
    sizes = shard_sizes(s)
    prompts = [[[rng.randrange(3, 50_000) for _ in range(s.prompt_tokens)] for _ in range(size)] for size in sizes]
    rows = {shard: list(range(size)) for shard, size in enumerate(sizes)}
    queue = list(range(s.shards))
    board = ProgressBoard()
    finished_at: list[float] = []
    busy_samples: list[int] = []
    peak_slots = 0

    async def run_shard(client: RoutingClient, shard: int) -> None:
        nonlocal peak_slots
        slots = CallSlots(s.max_inflight)
        report = {"shard_id": shard, "attempt": f"a{shard}", "generated": 0, "sent": 0.0}

        async def reporting() -> None:
            while True:
                share = board.report(dict(report))["share"]
                slots.set_limit(round(s.max_inflight * min(share, cap)))
                await asyncio.sleep(REPORT_SECONDS)

        async def sample(p: int, k: int) -> None:
            try:
                await client.generate(
                    f"s{shard}-p{p}-k{k}",
                    prompt_ids=prompts[shard][p],
                    sampling_params={"seed": (shard * 10_007 + p) * 64 + k},
                )
                finished_at.append(loop.time())
                report["generated"] += 1
            finally:
                slots.release()

        reporter = asyncio.ensure_future(reporting())
        tasks = []
        for p in rows[shard]:
            for k in range(s.n):
                await slots.acquire(False)
                peak_slots = max(peak_slots, slots.in_flight)
                tasks.append(asyncio.ensure_future(sample(p, k)))
        await asyncio.gather(*tasks)
        reporter.cancel()
        board.report(dict(report, ended=True))

    async def worker(w: int) -> None:
        client = RoutingClient(
            config, _Source(backends), chooser=ReplicaChooser("prefix_affinity", random.Random(s.seed * 100 + w))
        )
        while queue:
            await run_shard(client, queue.pop(0))
        await client.aclose()

    async def sampler() -> None:
        while True:
            busy_samples.append(sum(e.stats["running"] for e in engines))
            await asyncio.sleep(SAMPLE_SECONDS)

    watch = asyncio.ensure_future(sampler())
    await asyncio.gather(*(worker(w) for w in range(s.workers)))
    makespan = loop.time()
    watch.cancel()
    for e in engines:
        e.shutdown()
    slots_total = s.replicas * s.max_num_seqs
    last = busy_samples[int(0.8 * len(busy_samples)) :]
    ordered = sorted(finished_at)
    return {
        "trajectories": len(finished_at),
        "seconds": makespan,
        "traj_per_s": len(finished_at) / makespan,
        "tail": (makespan - ordered[int(0.99 * len(ordered)) - 1]) / makespan,
        "busy": sum(busy_samples) / (len(busy_samples) * slots_total),
        "busy_last": sum(last) / (len(last) * slots_total),
        "peak_slots": peak_slots,
    }


def run_scenario(s: Scenario, cap: int) -> dict[str, Any]:
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(_run(s, cap))
    finally:
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="mean prompts per shard")
    parser.add_argument(
        "--shard-sigma", type=float, default=0.8, help="lognormal sigma of the shard sizes (0: equal shards)"
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the response lengths")
    parser.add_argument("--cap", type=int, default=8, help="generation.inflight_share_cap of the 'after' rows")
    args = parser.parse_args()
    base = dict(
        workers=args.workers,
        shards=args.shards,
        mean_prompts=args.prompts,
        shard_sigma=args.shard_sigma,
        replicas=args.replicas,
        n=args.n,
        sigma=args.sigma,
    )
    scenarios = [
        Scenario("default max_inflight (64/shard)", max_inflight=64, **base),
        Scenario("in flight = slots (8/shard)", max_inflight=8, **base),
    ]
    print(
        "| scenario | shares | trajectories | sim s | traj/s | last 1% share | busy slots (run) | busy slots (last 20%) | most calls one shard had in flight |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in scenarios:
        rows = {"own max_inflight (cap 1)": run_scenario(s, 1), f"shared (cap {args.cap})": run_scenario(s, args.cap)}
        for name, r in rows.items():
            print(
                f"| {s.name} | {name} | {r['trajectories']} | {r['seconds']:.1f} | {r['traj_per_s']:.1f} | {r['tail']:.3f} | {r['busy']:.3f} | {r['busy_last']:.3f} | {r['peak_slots']} |"
            )
        before, after = rows.values()
        print(
            f"| {s.name} | after / before | | {after['seconds'] / before['seconds']:.2f} | {after['traj_per_s'] / before['traj_per_s']:.2f} | "
            f"{after['tail'] / before['tail']:.2f} | | {after['busy_last'] / before['busy_last']:.2f} | |"
        )


if __name__ == "__main__":
    main()
