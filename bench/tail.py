"""The end of a run on the simulated engine: each shard keeping its own max_inflight against the
run's in-flight budget shared by the shards still running (issue 34, item 5), side by side on
the same samples.

    .venv/bin/python bench/tail.py [--workers 16] [--shards 64] [--replicas 4] [--n 8] [--sigma 1.0]
    .venv/bin/python bench/tail.py --longest-first [--shards 512]   # generation.longest_first_from
    .venv/bin/python bench/tail.py --split --seeds 2 [--shards 512] [--max-inflight 8]   # each part of that order alone

`--longest-first`: tonight's run in dataset order against the same run ordered by last night's
lengths (genrun's inputs/length_hints.py ordering), where a share of each length's log-variance
comes from the prompt (engine_kwargs.simulated.response_tokens_prompt_share: 0, 0.5, 0.8) and the
rest from each request's seed, which differs between the nights.

Shard workers pull shards from one queue (as Prefect hands shard tasks to Ray workers: more
shards than workers), each shard's samples sent through genrun's `RoutingClient` (prefix-affinity
routing, the default) with genrun's `CallSlots` bounding its model calls. Every simulated second
each running shard reports to genrun's `ProgressBoard` (the Ray actor, called here in-process)
and its slots follow the share it answers, capped by `--cap` (generation.inflight_share_cap);
`--cap 1` is every shard on its own max_inflight, what genrun did before. Shard sizes are drawn
from a lognormal (`--shard-sigma`), response lengths too (`--sigma`); the replicas are
engines/simulated.py's (max_num_seqs slots, a decode step per token, prefill per uncached prompt
token), on a simulated clock: figures are simulated seconds, the same on any machine.

Printed per row: simulated seconds to the last trajectory, trajectories/s, the tail (the share of
the run's time its last 1% of trajectories take: from the 99th-percentile finish to the last), the
replicas' busy-slot fraction over the run and over its last 20%, and the most calls one shard had
in flight; then after/before ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scheduling import SimulatedBackend, _Source  # noqa: E402
from generation_core.engines.simulated import SimulatedEngine, SimulatedSettings, VirtualClockLoop  # noqa: E402
from generation_core.inputs.length_hints import LengthHints, rows_longest_first, shards_longest_first  # noqa: E402
from generation_core.run_plan import ShardSpec  # noqa: E402
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
    prompt_share: float = 0.0
    """engine_kwargs.simulated.response_tokens_prompt_share: how much of a length the prompt decides."""
    night: int = 0
    """Which night's run over the same prompts: another night draws other per-request seeds."""


def shard_sizes(s: Scenario) -> list[int]:
    """Prompts per shard: lognormal around the mean, at least one."""
    rng = random.Random(s.seed)
    raw = [rng.lognormvariate(0.0, s.shard_sigma) for _ in range(s.shards)]
    scale = s.mean_prompts * s.shards / sum(raw)
    return [max(1, round(r * scale)) for r in raw]


ORDERS = ("shards and rows", "shards only", "rows only", "biggest shard first")
"""--split: which part of genrun's order a run applies (the last: shards by size, rows by length)."""


async def _run(s: Scenario, cap: int, hints: dict[tuple[int, int], float] | None = None, order: str = ORDERS[0]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    engines = [
        SimulatedEngine(SimulatedSettings(
            prompt_length=s.prompt_tokens, response_length=s.response_length, eos_token_id=2, max_num_seqs=s.max_num_seqs, vocab_size=50_000,
            decode_seconds_per_step=0.02, prefill_seconds_per_token=0.0001, prefix_cache_tokens=65_536,
            response_tokens_median=s.median, response_tokens_sigma=s.sigma, seed=s.seed + r, response_tokens_prompt_share=s.prompt_share,
        ))
        for r in range(s.replicas)
    ]
    backends = {f"replica-{r}": SimulatedBackend(e) for r, e in enumerate(engines)}
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "simulated"}}, "generation": {"routing": "prefix_affinity"}})
    rng = random.Random(s.seed)
    sizes = shard_sizes(s)
    prompts = [[[rng.randrange(3, 50_000) for _ in range(s.prompt_tokens)] for _ in range(size)] for size in sizes]
    rows = {shard: list(range(size)) for shard, size in enumerate(sizes)}
    queue = list(range(s.shards))
    if hints is not None:
        # genrun's own ordering (inputs/length_hints.py) over prompts numbered across the shards.
        first = [sum(sizes[:shard]) for shard in range(s.shards)]
        numbered = np.array([(shard, p) for shard, size in enumerate(sizes) for p in range(size)])
        known = [i for i, (shard, p) in enumerate(numbered.tolist()) if (shard, p) in hints]
        by_prompt = LengthHints(np.array(known), np.array([hints[tuple(numbered[i].tolist())] for i in known]))
        specs = [ShardSpec(shard, first[shard], first[shard] + sizes[shard]) for shard in range(s.shards)]
        if order in ("shards and rows", "shards only"):
            queue = [spec.shard_id for spec in shards_longest_first(specs, np.arange(len(numbered)), by_prompt)]
        elif order == "biggest shard first":
            queue = sorted(queue, key=lambda shard: (-sizes[shard], shard))
        if order != "shards only":
            rows = {shard: rows_longest_first(np.arange(first[shard], first[shard] + sizes[shard]), by_prompt) for shard in range(s.shards)}
    lengths: dict[tuple[int, int], list[int]] = {}
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
                output = await client.generate(f"s{shard}-p{p}-k{k}", prompt_ids=prompts[shard][p], sampling_params={"seed": request_seed(shard, p, k, s.night)})
                lengths.setdefault((shard, p), []).append(len(output.token_ids))
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
        client = RoutingClient(config, _Source(backends), chooser=ReplicaChooser("prefix_affinity", random.Random(s.seed * 100 + w)))
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
    last = busy_samples[int(0.8 * len(busy_samples)):]
    ordered = sorted(finished_at)
    return {
        "trajectories": len(finished_at), "seconds": makespan, "traj_per_s": len(finished_at) / makespan,
        "tail": (makespan - ordered[int(0.99 * len(ordered)) - 1]) / makespan,
        "busy": sum(busy_samples) / (len(busy_samples) * slots_total), "busy_last": sum(last) / (len(last) * slots_total),
        "peak_slots": peak_slots, "lengths": {key: sum(v) / len(v) for key, v in lengths.items()},
    }


def request_seed(shard: int, prompt: int, sample: int, night: int) -> int:
    """Night 0's seeds are the ones this bench always used; another night's differ."""
    seed = (shard * 10_007 + prompt) * 64 + sample
    return seed if night == 0 else seed * 101 + night


def longest_first_rows(s: Scenario, cap: int) -> dict[str, dict[str, Any]]:
    """Tonight's run in genrun's default order and longest expected first, from last night's run
    over the same prompts (other per-request seeds: only the prompt's share of a length repeats)."""
    last_night = run_scenario(dataclasses.replace(s, night=1), cap)
    return {"dataset order": run_scenario(s, cap), "longest first (last night's lengths)": run_scenario(s, cap, last_night["lengths"])}


def _spread(values: list[float], spec: str) -> str:
    ordered = sorted(values)
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    return f"{median:{spec}}" if len(ordered) == 1 else f"{median:{spec}} [{ordered[0]:{spec}} - {ordered[-1]:{spec}}]"


def run_scenario(s: Scenario, cap: int, hints: dict[tuple[int, int], float] | None = None, order: str = ORDERS[0]) -> dict[str, Any]:
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(_run(s, cap, hints, order))
    finally:
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="mean prompts per shard")
    parser.add_argument("--shard-sigma", type=float, default=0.8, help="lognormal sigma of the shard sizes (0: equal shards)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the response lengths")
    parser.add_argument("--cap", type=int, default=8, help="generation.inflight_share_cap of the 'after' rows")
    parser.add_argument("--seeds", type=int, default=5, help="--longest-first: seeds per row")
    parser.add_argument("--split", action="store_true",
                        help="instead: each part of the order alone (one run per seed, prompt shares 0, 0.2, 0.3, 0.5, 0.8)")
    parser.add_argument("--max-inflight", type=int, default=64, help="--split: max_inflight per shard")
    parser.add_argument("--longest-first", action="store_true",
                        help="instead: genrun's default order against generation.longest_first_from, for prompt shares 0, 0.5 and 0.8")
    args = parser.parse_args()
    base = dict(workers=args.workers, shards=args.shards, mean_prompts=args.prompts, shard_sigma=args.shard_sigma, replicas=args.replicas, n=args.n, sigma=args.sigma)
    if args.split:
        print("| shards | max_inflight | prompt share | seed | dataset order | " + " | ".join(ORDERS) + " |")
        print("| --- | --- | --- | --- | --- |" + " --- |" * len(ORDERS))
        for share in (0.0, 0.2, 0.3, 0.5, 0.8):
            for seed in range(args.seeds):
                s = Scenario("split", max_inflight=args.max_inflight, prompt_share=share, seed=seed, **base)
                last_night = run_scenario(dataclasses.replace(s, night=1), args.cap)["lengths"]
                runs = [run_scenario(s, args.cap)] + [run_scenario(s, args.cap, last_night, order) for order in ORDERS]
                cells = [f"{r['seconds']:.1f} s, tail {r['tail']:.3f}" for r in runs]
                print(f"| {args.shards} | {args.max_inflight} | {share} | {seed} | " + " | ".join(cells) + " |", flush=True)
        return
    if args.longest_first:
        print(f"{args.seeds} seed(s) per row (shard sizes, prompts, replicas' draws); median [min - max] over them")
        print("| max_inflight | prompt share of the length | order | sim s | last 1% share | busy slots (last 20%) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for max_inflight in (8, 64):
            for share in (0.0, 0.5, 0.8):
                runs = [longest_first_rows(Scenario("longest first", max_inflight=max_inflight, prompt_share=share, seed=seed, **base), args.cap)
                        for seed in range(args.seeds)]
                for name in runs[0]:
                    print(f"| {max_inflight} | {share} | {name} | {_spread([r[name]['seconds'] for r in runs], '.1f')} | "
                          f"{_spread([r[name]['tail'] for r in runs], '.3f')} | {_spread([r[name]['busy_last'] for r in runs], '.3f')} |")
                ratios = [[after[key] / before[key] for before, after in (tuple(r.values()) for r in runs)] for key in ("seconds", "tail", "busy_last")]
                print(f"| {max_inflight} | {share} | after / before | {_spread(ratios[0], '.2f')} | {_spread(ratios[1], '.2f')} | {_spread(ratios[2], '.2f')} |", flush=True)
        return
    scenarios = [Scenario("default max_inflight (64/shard)", max_inflight=64, **base), Scenario("in flight = slots (8/shard)", max_inflight=8, **base)]
    print("| scenario | shares | trajectories | sim s | traj/s | last 1% share | busy slots (run) | busy slots (last 20%) | most calls one shard had in flight |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in scenarios:
        rows = {"own max_inflight (cap 1)": run_scenario(s, 1), f"shared (cap {args.cap})": run_scenario(s, args.cap)}
        for name, r in rows.items():
            print(f"| {s.name} | {name} | {r['trajectories']} | {r['seconds']:.1f} | {r['traj_per_s']:.1f} | {r['tail']:.3f} | {r['busy']:.3f} | {r['busy_last']:.3f} | {r['peak_slots']} |")
        before, after = rows.values()
        print(f"| {s.name} | after / before | | {after['seconds'] / before['seconds']:.2f} | {after['traj_per_s'] / before['traj_per_s']:.2f} | "
              f"{after['tail'] / before['tail']:.2f} | | {after['busy_last'] / before['busy_last']:.2f} | |")


if __name__ == "__main__":
    main()
