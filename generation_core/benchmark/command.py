"""`genrun bench`: how much of the engine's own throughput survives the pipeline, in one sitting.

    genrun bench [--sittings 3] [--prompts 64] [--tokens 32] [--json OUT] [--keep] [key=value ...]

Each sitting runs, on the same prompts, rollout.n and response length, the engine's own offline
benchmark (engine_side.py) and then a whole `genrun` run (genrun_side.py), and prints tokens/s of
each, genrun/engine and genrun's own CPU per trajectory outside the engine (process_cpu.py).
Machines are noisy (bench/RESULTS.md), so the answer is the median and the spread over sittings,
not one number. A line says when each side starts and ends. A sitting whose engine side was slower
than genrun's over the same engine, or that ran at a load average above the machine's cores, is
marked NOT TRUSTED and left out of the answer (`sitting_doubts`): a busy machine decided its
figures. The engine comes from the overrides (`actor_rollout_ref.rollout.name`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from generation_core.benchmark.engine_side import ENGINE_BENCHMARKS, ENGINE_SIDE
from generation_core.benchmark.genrun_side import genrun_run, override_key
from generation_core.benchmark.workload import prompt_ids, write_prompts
from generation_core.errors import GenrunError

CPU_NOT_AVAILABLE = "not available (it is read from Linux's /proc)"
USAGE = "usage: genrun bench [--sittings N] [--prompts N] [--tokens N] [--json OUT] [--keep] [key=value ...]"


@dataclass
class Sitting:
    engine_tokens: int
    engine_seconds: float
    genrun_tokens: int
    genrun_generation_seconds: float
    genrun_wall_seconds: float
    genrun_trajectories: int
    genrun_own_cpu_us_per_trajectory: float | None
    doubts: list[str] = field(default_factory=list)
    """Why its figures cannot be trusted (sitting_doubts); empty when nothing says so."""

    @property
    def engine_rate(self) -> float:
        return self.engine_tokens / self.engine_seconds

    @property
    def genrun_rate(self) -> float:
        return self.genrun_tokens / self.genrun_generation_seconds

    @property
    def ratio(self) -> float:
        return self.genrun_rate / self.engine_rate

    def line(self, number: int) -> str:
        cpu = self.genrun_own_cpu_us_per_trajectory
        return (
            f"  sitting {number}: engine {self.engine_rate:.1f} tokens/s ({self.engine_tokens} tokens in "
            f"{self.engine_seconds:.1f} s); genrun {self.genrun_rate:.1f} tokens/s ({self.genrun_tokens} tokens in a "
            f"{self.genrun_generation_seconds:.1f} s generation phase, {self.genrun_wall_seconds:.1f} s whole command); "
            f"genrun/engine {self.ratio:.2f}; genrun's own CPU outside the engine: "
            + (CPU_NOT_AVAILABLE if cpu is None else f"{cpu:.0f} us per trajectory")
            + (f"\n    NOT TRUSTED: {'; '.join(self.doubts)}" if self.doubts else "")
        )


def sitting_doubts(sitting: Sitting, load: float, cores: int) -> list[str]:
    """Why a sitting's figures cannot be trusted: an engine side slower than genrun's over the same
    engine (genrun adds work to the engine's, so something else took the engine side's CPU), or a
    load average above the machine's cores while it ran (`load`: the highest seen)."""
    doubts = []
    if sitting.engine_rate < sitting.genrun_rate:
        doubts.append(
            f"the engine side ({sitting.engine_rate:.1f} tokens/s) was slower than genrun's over the same engine "
            f"({sitting.genrun_rate:.1f}): the machine's other work decided both"
        )
    if load > cores:
        doubts.append(f"load average {load:.1f} above the {cores} core(s) while it ran")
    return doubts


@dataclass
class Workload:
    """What every sitting runs: the run's config, the prompts file, the engine's requests."""

    cfg: Any
    engine: str
    scratch: Path
    prompts_file: Path
    requests: list[list[int]]


class _Arguments(argparse.ArgumentParser):
    def error(self, message: str):  # one GenrunError line, not argparse's exit
        raise GenrunError(f"{message}; {USAGE}")


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The bench's options, declared once: for its own parsing and for `genrun bench --help`."""
    parser.add_argument(
        "--sittings",
        type=int,
        default=3,
        metavar="N",
        help="how many times both sides run, one after the other (default 3); the answer is the median and the "
        "spread over the sittings whose figures can be trusted",
    )
    parser.add_argument(
        "--prompts", type=int, default=64, metavar="N", help="prompts taken from data.train_files (default 64)"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=32,
        metavar="N",
        help="tokens every response runs to, on both sides (default 32; sets data.max_response_length)",
    )
    parser.add_argument(
        "--json", metavar="OUT", help="write the figures there (default: bench.json in the scratch folder, kept)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the scratch folder (the runs' folders, logs and timelines)"
    )
    return parser


def parse_bench_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = add_bench_arguments(_Arguments(prog="genrun bench", add_help=False))
    args, overrides = parser.parse_known_args(argv)
    unknown = [item for item in overrides if item.startswith("-")]
    if unknown:
        raise GenrunError(f"unknown option {unknown[0]}; {USAGE}")
    for name in ("sittings", "prompts", "tokens"):
        if getattr(args, name) < 1:
            raise GenrunError(f"--{name} must be an integer >= 1, got {getattr(args, name)}")
    owned = [
        item for item in overrides if override_key(item) in ("data.max_response_length", "trainer.default_local_dir")
    ]
    if owned:
        raise GenrunError(f"{override_key(owned[0])} is set by the bench (--tokens, its scratch folder); leave it out")
    return args, overrides


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def bench_command(argv: list[str]) -> int:
    args, overrides = parse_bench_arguments(argv)
    work = _workload(args, overrides)
    n = work.cfg.actor_rollout_ref.rollout.n
    print(
        f"genrun bench: {work.engine}, {args.prompts} prompts x n={n} = {len(work.requests)} requests, "
        f"{args.tokens} tokens each, {args.sittings} sitting(s); engine side: {ENGINE_SIDE[work.engine]}; "
        f"scratch: {work.scratch}",
        flush=True,
    )
    sittings = [_sitting(work, args, overrides, number) for number in range(1, args.sittings + 1)]
    result = _figures(work, args, sittings)
    print(ratio_line(sittings))
    print(cpu_summary(result["genrun_own_cpu_us_per_trajectory"]))
    _write_figures(args, result, work.scratch)
    return 0


def _sitting(work: Workload, args: argparse.Namespace, overrides: list[str], number: int) -> Sitting:
    """Both sides of one sitting, a line as each starts and ends (a side takes minutes on a busy machine)."""
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]
    print(f"  sitting {number}: the engine side ({ENGINE_SIDE[work.engine]}) ...", flush=True)
    engine_tokens, engine_seconds = ENGINE_BENCHMARKS[work.engine](work.cfg, work.requests, args.tokens)
    load = max(load, os.getloadavg()[0])
    print(
        f"  sitting {number}: the engine side gave {engine_tokens / engine_seconds:.1f} tokens/s ({engine_tokens} "
        f"tokens in {engine_seconds:.1f} s); now a whole genrun run ...",
        flush=True,
    )
    run = genrun_run(overrides, work.prompts_file, args.tokens, work.scratch / f"sitting-{number}")
    sitting = Sitting(engine_tokens, engine_seconds, *run)
    sitting.doubts = sitting_doubts(sitting, max(load, os.getloadavg()[0]), cores)
    print(sitting.line(number), flush=True)
    return sitting


def ratio_line(sittings: list[Sitting]) -> str:
    """genrun/engine over the sittings whose figures can be trusted, and what was left out; when
    none can be, over all of them, marked NOT TRUSTED."""
    trusted = [s.ratio for s in sittings if not s.doubts]
    ratio = spread(trusted or [s.ratio for s in sittings])
    figure = (
        f"genrun/engine: median {ratio['median']:.2f} (min {ratio['min']:.2f}, max {ratio['max']:.2f}) "
        f"over {len(trusted or sittings)} sitting(s)"
    )
    if not trusted:
        return (
            f"{figure}: NOT TRUSTED, no sitting's figures can be (see above); "
            "run it again on a quiet machine (a load average below its cores)"
        )
    left_out = len(sittings) - len(trusted)
    return figure + (f"; {left_out} not trusted, left out" if left_out else "")


def cpu_summary(cpu: dict[str, float] | None) -> str:
    figure = f"median {cpu['median']:.0f} us per trajectory (min {cpu['min']:.0f}, max {cpu['max']:.0f})" if cpu else ""
    return (
        f"genrun's own CPU outside the engine: {figure or CPU_NOT_AVAILABLE} over the generation phase "
        "(driver, shard workers, progress board, server registry; the engine's server-actor processes are left out "
        "whole: there the engine's compute cannot be told apart from the actor's own work)"
    )


def _workload(args: argparse.Namespace, overrides: list[str]) -> Workload:
    """Every input check first, as a run does; then the prompts, written once for every sitting."""
    from generation_core.config.loading import train_files
    from generation_core.preflight.preflight import preflight

    cfg = preflight(overrides).cfg
    engine = cfg.actor_rollout_ref.rollout.name
    if engine not in ENGINE_BENCHMARKS:
        raise GenrunError(
            f"genrun bench has no engine-side benchmark for rollout.name={engine}; "
            f"it measures {', '.join(ENGINE_BENCHMARKS)}"
        )
    scratch = Path(tempfile.mkdtemp(prefix="genrun-bench-"))
    prompts_file = scratch / "prompts.parquet"
    write_prompts(train_files(cfg), prompts_file, args.prompts, cfg.data.prompt_key)
    requests = [ids for ids in prompt_ids(cfg, prompts_file) for _ in range(cfg.actor_rollout_ref.rollout.n)]
    return Workload(cfg, engine, scratch, prompts_file, requests)


def _figures(work: Workload, args: argparse.Namespace, sittings: list[Sitting]) -> dict[str, Any]:
    cpu = [s.genrun_own_cpu_us_per_trajectory for s in sittings if s.genrun_own_cpu_us_per_trajectory is not None]
    return {
        "engine": work.engine,
        "engine_side": ENGINE_SIDE[work.engine],
        "model": work.cfg.actor_rollout_ref.model.path,
        "prompts": args.prompts,
        "n": work.cfg.actor_rollout_ref.rollout.n,
        "tokens": args.tokens,
        "requests": len(work.requests),
        "sittings": [
            dict(
                asdict(s),
                engine_tokens_per_s=round(s.engine_rate, 2),
                genrun_tokens_per_s=round(s.genrun_rate, 2),
                ratio=round(s.ratio, 4),
            )
            for s in sittings
        ],
        "ratio": spread([s.ratio for s in sittings]),
        # Over the sittings nothing casts doubt on (None: every one is in doubt; each sitting's `doubts` say why).
        "trusted_ratio": spread(trusted) if (trusted := [s.ratio for s in sittings if not s.doubts]) else None,
        "engine_tokens_per_s": spread([s.engine_rate for s in sittings]),
        "genrun_tokens_per_s": spread([s.genrun_rate for s in sittings]),
        "genrun_own_cpu_us_per_trajectory": spread(cpu) if len(cpu) == len(sittings) else None,
    }


def _write_figures(args: argparse.Namespace, result: dict[str, Any], scratch: Path) -> None:
    """The figures as JSON (--json, else into the scratch folder); the scratch folder goes unless
    it holds the only copy (no --json) or --keep keeps it."""
    out = Path(args.json) if args.json else scratch / "bench.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"written: {out}")
    if args.json and not args.keep:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    elif args.keep:
        print(f"kept: {scratch} (the runs' folders, logs and timelines)")
