"""Routing at scale on the simulated engine (issue 34, items 2 and 3): each routing mode on the
same samples, side by side.

    .venv/bin/python bench/scheduling.py [--workers 16] [--replicas 4] [--prompts 32] [--n 8] [--sigma 1.0] [--smoke]

Shard workers (genrun's `RoutingClient` each) send their samples to simulated replicas, all in this
process on a simulated clock (`VirtualClockLoop`: the same figures on any machine), routed `local`
(by this worker's own outstanding requests), `least_loaded` (the shared load) or `prefix_affinity`
(a prompt's n samples on one replica). Prefix hits count against all prompt tokens and against the
reusable ones (those an earlier request had: what one shared, unbounded cache could reuse).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sim.engine import SimulatedEngine, SimulatedSettings, VirtualClockLoop, block_keys  # noqa: E402
from generation_core.engines.base import EngineStopped, prefix_hit_rate  # noqa: E402
from generation_core.serving.replica_loads import ReplicaChooser  # noqa: E402
from generation_core.serving.routing import RoutingClient  # noqa: E402

MODES = ("local", "least_loaded", "prefix_affinity")
FRACTIONS = ("imbalance", "inst_imbalance", "hit_rate", "hit_of_reusable")
SAMPLE_SECONDS = 0.1


class SimulatedBackend:
    """A simulated replica as a routing backend in this process; it reports its load with every
    answer, as EngineServer does with every group of answers."""

    server_failures = (EngineStopped,)
    probe_interval = 1.0

    def __init__(self, engine: SimulatedEngine):
        self.engine = engine
        self._report: Any = None

    def watch_load(self, report) -> None:
        self._report = report

    async def read_load(self) -> int:
        return self.engine.load

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any):
        output = await self.engine.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
        if self._report is not None:
            self._report(self.engine.load, 1)
        return output

    async def probe(self) -> bool:
        return True


class _Source:
    def __init__(self, backends: dict[str, SimulatedBackend]):
        self.backends = backends

    async def connect(self, wait_seconds: float = 0.0):
        return dict(self.backends), {}

    async def aclose(self) -> None:
        return None


@dataclass
class Scenario:
    """The replicas' step and prefill costs and prefix cache: the simulated engine's defaults."""

    name: str
    workers: int = 16
    replicas: int = 4
    prompts_per_worker: int = 32
    n: int = 8
    max_inflight: int = 64
    max_num_seqs: int = 32
    system_tokens: int = 64
    prompt_tokens: int = 448
    median: int = 64
    sigma: float = 1.0
    response_length: int = 1024
    seed: int = 0


@dataclass
class Outcome:
    trajectories: int = 0
    request_ids: list[str] = field(default_factory=list)
    finished_at: list[float] = field(default_factory=list)
    reusable_tokens: int = 0
    samples: list[list[int]] = field(default_factory=list)


def _prompts(s: Scenario) -> list[list[list[int]]]:
    rng = random.Random(s.seed)
    system = [rng.randrange(3, 50_000) for _ in range(s.system_tokens)]
    return [
        [system + [rng.randrange(3, 50_000) for _ in range(s.prompt_tokens)] for _ in range(s.prompts_per_worker)]
        for _ in range(s.workers)
    ]


async def _run(s: Scenario, mode: str) -> dict[str, Any]:
    shape = dict(prompt_length=s.system_tokens + s.prompt_tokens, response_length=s.response_length, eos_token_id=2)
    shape.update(max_num_seqs=s.max_num_seqs, vocab_size=50_000)
    lengths = dict(response_tokens_median=s.median, response_tokens_sigma=s.sigma)
    engines = [SimulatedEngine(SimulatedSettings(**shape, **lengths, seed=s.seed + r)) for r in range(s.replicas)]
    backends = {f"replica-{r}": SimulatedBackend(e) for r, e in enumerate(engines)}
    config = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"name": "simulated"}}, "generation": {"routing": mode}}
    )
    outcome, seen_blocks = Outcome(), set()
    prompts = _prompts(s)
    loop = asyncio.get_running_loop()

    async def sample(client: RoutingClient, w: int, p: int, k: int) -> None:
        prompt = prompts[w][p]
        keys = block_keys(prompt, 16)
        outcome.reusable_tokens += 16 * next((i for i, key in enumerate(keys) if key not in seen_blocks), len(keys))
        seen_blocks.update(keys)
        request_id = f"w{w}-p{p}-s{k}"
        await client.generate(
            request_id, prompt_ids=prompt, sampling_params={"temperature": 1.0, "seed": (w * 1_000_003 + p) * 64 + k}
        )
        outcome.trajectories += 1
        outcome.request_ids.append(request_id)
        outcome.finished_at.append(loop.time())

    async def worker(w: int) -> None:
        client = RoutingClient(config, _Source(backends), chooser=ReplicaChooser(mode, random.Random(s.seed * 100 + w)))
        slots = asyncio.Semaphore(s.max_inflight)
        tasks = []
        for p in range(s.prompts_per_worker):
            for k in range(s.n):
                await slots.acquire()
                task = asyncio.ensure_future(sample(client, w, p, k))
                task.add_done_callback(lambda _: slots.release())
                tasks.append(task)
        await asyncio.gather(*tasks)
        await client.aclose()

    async def sampler() -> None:
        while True:
            outcome.samples.append([e.stats["running"] for e in engines])
            await asyncio.sleep(SAMPLE_SECONDS)

    watch = asyncio.ensure_future(sampler())
    workers = [asyncio.ensure_future(worker(w)) for w in range(s.workers)]
    # "While work remains": until the last sample of every worker is sent.
    sent_all = asyncio.ensure_future(_all_sent(engines, s))
    await asyncio.gather(*workers)
    makespan = loop.time()
    busy, samples_at_sent = await sent_all
    watch.cancel()
    for e in engines:
        e.shutdown()
    steady = [row for row in outcome.samples[:samples_at_sent] if sum(row)]
    stats = [e.stats for e in engines]
    reused = sum(st["prefix_reused_tokens"] for st in stats)
    return {
        "mode": mode,
        "trajectories": outcome.trajectories,
        "unique": len(set(outcome.request_ids)),
        "seconds": makespan,
        "traj_per_s": outcome.trajectories / makespan,
        "tokens_per_s": sum(st["generated_tokens"] for st in stats) / makespan,
        "imbalance": max(busy) / (sum(busy) / len(busy)) if sum(busy) else 1.0,
        "inst_imbalance": sum(max(row) / (sum(row) / len(row)) for row in steady) / max(len(steady), 1),
        "hit_rate": prefix_hit_rate(
            {"prefix_reused_tokens": reused, "prefill_tokens": sum(st["prefill_tokens"] for st in stats)}
        ),
        "hit_of_reusable": reused / outcome.reusable_tokens if outcome.reusable_tokens else None,
        "replica_hit_rates": [prefix_hit_rate(st) for st in stats],
        # The tail (item 5): the share of the run's time its last 1% of trajectories take.
        "last_1pct_share": (makespan - sorted(outcome.finished_at)[int(0.99 * len(outcome.finished_at)) - 1])
        / makespan,
    }


async def _all_sent(engines: list[SimulatedEngine], s: Scenario) -> tuple[list[float], int]:
    """The replicas' busy slot-seconds once every sample has been sent (requests counted by the
    engines reach the total), and the number of load samples taken by then."""
    total = s.workers * s.prompts_per_worker * s.n
    loop = asyncio.get_running_loop()
    while sum(e.stats["requests"] for e in engines) < total:
        await asyncio.sleep(SAMPLE_SECONDS / 10)
    return [e.stats["busy_slot_seconds"] for e in engines], int(loop.time() / SAMPLE_SECONDS) + 1


def run_scenario(s: Scenario, mode: str) -> dict[str, Any]:
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(_run(s, mode))
    finally:
        loop.close()


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per shard worker")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the response lengths")
    parser.add_argument("--smoke", action="store_true", help="seconds: 2 workers, 2 replicas, 2 prompts, n=2")
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.replicas, args.prompts, args.n = 2, 2, 2, 2
    base = dict(
        workers=args.workers, replicas=args.replicas, prompts_per_worker=args.prompts, n=args.n, sigma=args.sigma
    )
    scenarios = [
        # genrun's default max_inflight: 2 x max_num_seqs per shard worker, queues on every replica.
        Scenario("default max_inflight (64/worker)", max_inflight=64, **base),
        # As many requests in flight as the replicas have slots: where a pile-up leaves slots idle.
        Scenario("in flight = slots (8/worker)", max_inflight=8, **base),
    ]
    columns = "trajectories (unique) | sim s | traj/s | tokens/s | imbalance (time-avg) | imbalance (instant)"
    print(f"| scenario | routing | {columns} | prefix hit rate | hit / reusable | per replica | last 1% share |")
    print("| --- " * 12 + "|")
    for s in scenarios:
        rows = {mode: run_scenario(s, mode) for mode in MODES}
        for mode, r in rows.items():
            figures = [f"{r['trajectories']} ({r['unique']})", f"{r['seconds']:.1f}", f"{r['traj_per_s']:.1f}"]
            figures += [f"{r['tokens_per_s']:.0f}", *map(_fmt, [r[key] for key in FRACTIONS])]
            figures += [" ".join(_fmt(h, 2) for h in r["replica_hit_rates"]), _fmt(r["last_1pct_share"])]
            print(f"| {s.name} | {mode} | " + " | ".join(figures) + " |")
        local = rows["local"]
        for mode in MODES[1:]:
            gains = [rows[mode][key] / local[key] for key in ("traj_per_s", "tokens_per_s")]
            print(f"| {s.name} | {mode} / local | | | {gains[0]:.2f} | {gains[1]:.2f} | | | | | | |")


if __name__ == "__main__":
    main()
