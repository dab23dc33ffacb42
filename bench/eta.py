"""How far the progress line's ETA is from the truth on a long-tailed run (issue 35, item 3).

    .venv/bin/python bench/eta.py [--prompts 2400] [--shards 3] [--inflight 16] [--delay 0.2] [--sigma 1.0]

One in-process run (the shard code a Prefect shard task runs) on the instant engine with a
seeded long-tailed delay and length per request (engine_kwargs.instant.delay_sigma: log-normal,
median --delay seconds; sigma 1.0 puts the slowest 1% at ~10x the median). Every driver tick
(0.5 s) records the progress numbers; once the run is done the true remaining time of each tick
is known. Error of a prediction = |ETA - true remaining| / the generation's whole duration
(first shard report -> last trajectory generated). Side by side, from the same ticks:
- `eta`: the ETA the progress line shows (shard/eta.py: the run's rate since generation
  started, and each running shard's rows at its own rate);
- `window`: what it showed before (remaining / the last minute's rate).
Printed: median and max error of each once 10% of the run is done, and their ratio; the target
is a max error <= 10%. Then the run's own verdict: manifest.json's ledger `eta` (the trace the
driver kept of the ETAs it showed, judged against when its progress line reached the end), and
with `--report DIR` the run report (its Capacity section plots predicted vs actual) is copied there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET = 0.10
SAMPLE_TRACE_ENV = "GENRUN_SAMPLE_TRACE"


def write_prompts(path: Path, count: int) -> Path:
    rows = [
        {
            "data_source": "bench",
            "prompt": [{"role": "user", "content": f"Say something about item {i}."}],
            "ability": "chat",
            "reward_model": {"style": "none", "ground_truth": ""},
            "extra_info": {"split": "bench", "index": i},
        }
        for i in range(count)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def run(
    args: argparse.Namespace, scratch: Path
) -> tuple[list[tuple[float, int, int, float | None, float | None]], float, dict]:
    """(unix time, done + failed, total, eta, window eta) at every driver tick, when the last
    trajectory finished (the sample trace: GENRUN_SAMPLE_TRACE), and the ledger's `eta`."""
    from generation_core.driver import run_watch
    from generation_core.driver.in_process import run_in_process
    from generation_core.plan.preflight import preflight

    ticks: list[tuple[float, int, int, float | None, float | None]] = []
    original_tick = run_watch.RunWatch.tick

    def recording_tick(self):
        totals = original_tick(self)
        remaining = max(totals.total - totals.done - totals.failed, 0)
        window = remaining / totals.rate if totals.rate else None
        ticks.append((time.time(), totals.done + totals.failed, totals.total, totals.eta, window))
        return totals

    run_watch.RunWatch.tick = recording_tick  # type: ignore[method-assign]
    prompts = write_prompts(scratch / "prompts.parquet", args.prompts)
    plan = preflight(
        [
            f"data.train_files={prompts}",
            f"trainer.default_local_dir={scratch / 'run'}",
            "actor_rollout_ref.rollout.name=instant",
            f"actor_rollout_ref.rollout.engine_kwargs.instant.delay_seconds={args.delay}",
            f"actor_rollout_ref.rollout.engine_kwargs.instant.delay_sigma={args.sigma}",
            "actor_rollout_ref.rollout.engine_kwargs.instant.response_tokens=32",
            "actor_rollout_ref.rollout.response_length=512",
            f"generation.num_shards={args.shards}",
            f"generation.max_inflight={args.inflight}",
            "generation.show_progress=false",
        ]
    )
    trace = scratch / "samples.trace"
    os.environ[SAMPLE_TRACE_ENV] = str(trace)
    summary = run_in_process(plan)
    ended = max(float(line.split()[0]) for line in trace.read_text().splitlines())
    if args.report:
        from generation_core.report.html import REPORT_FILE, write_report
        from generation_core.store.folder import StorageFolder

        write_report(StorageFolder(str(scratch / "run")))
        Path(args.report).mkdir(parents=True, exist_ok=True)
        shutil.copy(scratch / "run" / REPORT_FILE, Path(args.report) / REPORT_FILE)
    return ticks, ended, summary["ledger"].get("eta") or {}


def generation_start(ticks) -> float:
    """The tick before the first one that counted a trajectory."""
    first = next(i for i, tick in enumerate(ticks) if tick[1] > 0)
    return ticks[max(first - 1, 0)][0]


def errors(ticks, ended: float, column: int) -> list[float]:
    """Each tick's relative error once 10% of the run was done and before its end."""
    total = ticks[-1][2]
    duration = ended - generation_start(ticks)
    out = []
    for tick in ticks:
        t, done, _, *etas = tick
        eta = etas[column]
        if done < TARGET * total or done >= total or t >= ended:
            continue
        out.append(float("inf") if eta is None else abs(eta - (ended - t)) / duration)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=2400)
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--json", help="write the ticks and the end time here")
    parser.add_argument("--report", help="copy the run's report.html into this folder")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="genrun-bench-eta-"))
    try:
        ticks, ended, ledger_eta = run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"ticks": ticks, "ended": ended}))
    new, old = errors(ticks, ended, 0), errors(ticks, ended, 1)
    print(
        f"run: {ticks[-1][2]} trajectories, {args.shards} shards, max_inflight {args.inflight}, delay median {args.delay} s sigma {args.sigma}; "
        f"generation {ended - generation_start(ticks):.1f} s, {len(new)} ticks past 10% done"
    )
    for name, values in (("eta (shard/eta.py)", new), ("window (last minute's rate)", old)):
        print(f"{name:30s} median error {statistics.median(values):6.1%}  max error {max(values):6.1%}")
    print(
        f"ratio window/eta: median {statistics.median(old) / statistics.median(new):.2f}, max {max(old) / max(new):.2f}"
    )
    print(f"target: max error <= {TARGET:.0%} once 10% is done: {'met' if max(new) <= TARGET else 'NOT met'}")
    if ledger_eta.get("max_error") is not None:
        print(
            f"the run's own ledger (manifest.json eta, {len(ledger_eta['points'])} points, generation {ledger_eta['generation_seconds']:.1f} s): "
            f"median error {ledger_eta['median_error']:.1%}  max error {ledger_eta['max_error']:.1%}"
        )


if __name__ == "__main__":
    main()
