"""Slots per model call: how full the engine's batch stays while tools run, before and after.

    PYTHONPATH=. .venv/bin/python -u bench/slots_per_call.py [--trajectories 480] [--max-num-seqs 16]
        [--call-seconds 0.1] [--tool-seconds 0 0.1 0.3] [--rounds 1]

One shard's stream (shard/streaming.py, verl's ToolAgentLoop with the tool example's calculator,
examples/tool_calling) runs in this process against a simulated engine: the scripted tool-calling
engine of the tests (a calculator call, then the answer after the tool's reply) behind a decode
batch of `--max-num-seqs` sequences, each model call running `--call-seconds` once admitted,
the others queued in arrival order as SGLang and vLLM queue them. The calculator answers after
each `--tool-seconds` (0: the example as shipped). `generation.max_inflight` is left at its
default, twice max_num_seqs.

Before: one model-call slot per open trajectory from its start to its end
(`generation.max_open_trajectories` = `max_inflight`, what the stream did before slots per call).
After: the default (`max_open_trajectories` null, 8 x max_inflight): a trajectory in its tool
holds no slot, and a freed slot goes to a later turn first.

Printed per tool latency, before and after in one sitting: the engine's occupancy (running
requests / max_num_seqs, time-weighted) from the first moment the batch is full until the last
prompt started (while the slots have new work to give the engine), its lowest over
`--window`-second windows of that period, the same occupancy until fewer than max_num_seqs
trajectories remain unfinished (past that the batch cannot be full; near the end the remaining
trajectories may all be in their tools, the tail issue 34 item 5 is about),
trajectories/s, the open-trajectory limit, and the count check (every trajectory once).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from examples.tool_calling.calculator import CalculatorTool  # noqa: E402
from tests.scripted_engine import ScriptedEngine  # noqa: E402

TOOL_SECONDS = 0.0


class SlowCalculatorTool(CalculatorTool):
    """The example's calculator, answering after TOOL_SECONDS (set per run)."""

    async def execute(self, instance_id, parameters, **kwargs):
        if TOOL_SECONDS:
            await asyncio.sleep(TOOL_SECONDS)
        return await super().execute(instance_id, parameters, **kwargs)


class BatchEngine(ScriptedEngine):
    """The scripted engine behind a decode batch of max_num_seqs; records running requests over time."""

    def __init__(self, tokenizer, max_num_seqs: int, call_seconds: float):
        super().__init__(tokenizer)
        self.max_num_seqs = max_num_seqs
        self.call_seconds = call_seconds
        self.running = 0
        self.queue: deque[asyncio.Future] = deque()
        self.changes: list[tuple[float, int]] = []

    def _set_running(self, value: int) -> None:
        self.running = value
        self.changes.append((time.perf_counter(), value))

    async def generate(self, request_id, **kwargs):
        if self.running >= self.max_num_seqs or self.queue:
            waiter = asyncio.get_running_loop().create_future()
            self.queue.append(waiter)
            await waiter  # the slot is handed over with running unchanged
        else:
            self._set_running(self.running + 1)
        try:
            await asyncio.sleep(self.call_seconds)
            return await super().generate(request_id, **kwargs)
        finally:
            if self.queue:
                self.queue.popleft().set_result(None)
            else:
                self._set_running(self.running - 1)


def occupancy(
    changes: list[tuple[float, int]], start: float, end: float, max_num_seqs: int, window: float = 0.05
) -> tuple[float, float]:
    """Time-weighted mean of running / max_num_seqs over [start, end], and its lowest over whole windows."""
    if end <= start:
        return float("nan"), float("nan")
    times = [start] + [t for t, _ in changes if start < t < end] + [end]
    values = [0] + [v for t, v in changes if start < t < end]
    # The value at `start`: the last change at or before it.
    values[0] = next((v for t, v in reversed(changes) if t <= start), 0)
    segments = list(zip(times, times[1:], values, strict=False))

    def area(lo: float, hi: float) -> float:
        return sum(v * (min(t1, hi) - max(t0, lo)) for t0, t1, v in segments if t1 > lo and t0 < hi)

    windows = int((end - start) // window)
    lows = [area(start + k * window, start + (k + 1) * window) / window / max_num_seqs for k in range(windows)]
    return area(start, end) / (end - start) / max_num_seqs, min(lows) if lows else float("nan")


def run_once(model_dir: Path, tokenizer, tools_yaml: Path, args, tool_seconds: float, before: bool) -> dict:
    # verl imports the tool class by name (slots_per_call.SlowCalculatorTool), a module apart from __main__.
    import slots_per_call

    slots_per_call.TOOL_SECONDS = tool_seconds
    from generation_core.config.loading import load_config
    from generation_core.config.settings import GenerationSettings
    from generation_core.shard.streaming import StreamingWorker

    cfg = load_config(
        [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"data.tool_config_path={tools_yaml}",
            f"actor_rollout_ref.rollout.max_num_seqs={args.max_num_seqs}",
            "generation.show_progress=false",
        ]
    )
    cfg.actor_rollout_ref.model.path = str(model_dir)
    gen = GenerationSettings.of(cfg)
    max_open = gen.inflight_limit if before else gen.open_trajectories_limit
    engine = BatchEngine(tokenizer, args.max_num_seqs, args.call_seconds)
    worker = StreamingWorker(cfg, engine)
    samples = [
        (
            (i, 0),
            {
                "raw_prompt": [{"role": "user", "content": f"Compute {i}+{i} with the calculator."}],
                "agent_name": "tool_agent",
                "index": i,
                "extra_info": {"index": i},
            },
        )
        for i in range(args.trajectories)
    ]
    finished_at: list[float] = []
    last_started: list[float] = []

    def drawn():
        yield from samples
        last_started.append(time.perf_counter())

    keys: list[tuple[int, int]] = []

    async def consume() -> None:
        async for item in worker.stream(drawn(), gen.inflight_limit, idle_timeout=5.0, max_open=max_open):
            if item is None:
                continue
            assert not hasattr(item, "error_type"), f"a sample failed: {item}"
            keys.append((item.index, item.rollout_n))
            finished_at.append(time.perf_counter())

    started = time.perf_counter()
    asyncio.run(consume())
    wall = time.perf_counter() - started
    worker.shutdown()
    # While at least max_num_seqs trajectories are unfinished the batch could be full.
    until = finished_at[len(finished_at) - args.max_num_seqs] if len(finished_at) >= args.max_num_seqs else started
    # From the batch's first full moment (the first calls are being built before it) until the
    # last prompt started (what the slots decide), and until too few trajectories remain to fill it.
    full = next((t for t, v in engine.changes if v >= args.max_num_seqs), until)
    mean, low = occupancy(engine.changes, full, last_started[0], args.max_num_seqs, window=args.window)
    mean_all, _ = occupancy(engine.changes, full, until, args.max_num_seqs, window=args.window)
    return {
        "occupancy": mean,
        "min_window": low,
        "occupancy_all": mean_all,
        "per_s": len(keys) / wall,
        "wall": wall,
        "exact": sorted(keys) == [(i, 0) for i in range(args.trajectories)],
        "calls": len(engine.calls),
        "max_open": max_open,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=480)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--call-seconds", type=float, default=0.1)
    parser.add_argument("--tool-seconds", type=float, nargs="+", default=[0.0, 0.1, 0.3])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--window", type=float, default=0.25, help="seconds per window of the lowest-window column")
    args = parser.parse_args()

    from verl.utils import hf_tokenizer

    from generation_core.config.bundled import prepare_bundled_model

    model_dir = prepare_bundled_model()
    tokenizer = hf_tokenizer(str(model_dir))
    scratch = Path(tempfile.mkdtemp(prefix="slots-"))
    tools_yaml = scratch / "tools.yaml"
    tools_yaml.write_text("tools:\n  - class_name: slots_per_call.SlowCalculatorTool\n    config: {type: native}\n")

    print(
        f"{args.trajectories} tool trajectories (2 model calls each), max_num_seqs {args.max_num_seqs}, "
        f"max_inflight {2 * args.max_num_seqs}, model call {args.call_seconds:g} s"
    )
    print(
        "| tool s | run | max open | occupancy, prompts unstarted | lowest window | occupancy, >= max_num_seqs unfinished | trajectories/s | each once | after/before occupancy | after/before rate |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for _ in range(args.rounds):
        for tool_seconds in args.tool_seconds:
            before = run_once(model_dir, tokenizer, tools_yaml, args, tool_seconds, before=True)
            after = run_once(model_dir, tokenizer, tools_yaml, args, tool_seconds, before=False)
            for name, r in (("before", before), ("after", after)):
                ratios = (
                    f"{after['occupancy'] / before['occupancy']:.2f} | {after['per_s'] / before['per_s']:.2f}"
                    if name == "after"
                    else " | "
                )
                print(
                    f"| {tool_seconds:g} | {name} | {r['max_open']} | {r['occupancy']:.3f} | {r['min_window']:.2f} | {r['occupancy_all']:.3f} | {r['per_s']:.1f} | {r['exact']} | {ratios} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
