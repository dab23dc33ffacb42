"""`genrun bench`: the engine's own benchmark and a whole genrun run on the same prompts and
lengths, per sitting (hf here; remote in test_remote_vllm.py; sglang and vllm need GPUs)."""

from __future__ import annotations

import json
import subprocess
import time

import psutil
import pytest

from tests.conftest import GENRUN, REPO, kill_group

pytestmark = pytest.mark.timeout(400)

# A bench that used no CPU for this long has hung; one that works goes on, however busy the machine.
STALL_SECONDS = 300.0
# The whole bench at most: minutes on a quiet machine, many times that at a load of 10 to 25.
CAP_SECONDS = 1500.0


def run_while_it_works(args: list[str], folder) -> subprocess.CompletedProcess:
    """`genrun ARGS` to its end, waiting on what it does rather than on a clock: it is stopped
    (and the test fails) only when its processes together used no CPU for STALL_SECONDS, or after
    CAP_SECONDS in all."""
    out, err = folder / "stdout.txt", folder / "stderr.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(GENRUN + args, cwd=REPO, stdout=stdout, stderr=stderr, start_new_session=True)
    started = last_work = time.monotonic()
    seen: dict[int, float] = {}
    work = 0.0
    try:
        while process.poll() is None:
            now_cpu = _tree_cpu_seconds(process.pid)
            # Each process's own growth: one that ended takes its CPU out of a plain sum.
            work += sum(max(0.0, cpu - seen.get(pid, 0.0)) for pid, cpu in now_cpu.items())
            seen.update(now_cpu)
            if work >= 0.5:
                work, last_work = 0.0, time.monotonic()
            now = time.monotonic()
            assert now - last_work < STALL_SECONDS, f"genrun bench used no CPU for {STALL_SECONDS:.0f} s: hung"
            assert now - started < CAP_SECONDS, f"genrun bench still running after {CAP_SECONDS:.0f} s"
            time.sleep(5)
    finally:
        kill_group(process)
    return subprocess.CompletedProcess(process.args, process.returncode, out.read_text(), err.read_text())


def _tree_cpu_seconds(pid: int) -> dict[int, float]:
    """pid -> CPU seconds, for `pid` and every process below it (those running now)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    seconds = {}
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        seconds[process.pid] = times.user + times.system
    return seconds


@pytest.mark.timeout(CAP_SECONDS + 100)
def test_bench_runs_both_sides_on_the_same_tokens_and_reports_the_ratio(tmp_path, prompts_file):
    """Issue 51 item 7: its 360 s deadline ran out at a load of 10 to 25; it now waits while the
    bench works (run_while_it_works)."""
    out = tmp_path / "bench.json"
    # Prompts from the user's dataset (12 rows; the first 6 taken), rollout.n from the overrides.
    result = run_while_it_works(
        [
            "bench",
            "--sittings",
            "1",
            "--prompts",
            "6",
            "--tokens",
            "5",
            "--json",
            str(out),
            f"data.train_files={prompts_file}",
            "actor_rollout_ref.rollout.n=2",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    bench = json.loads(out.read_text())
    assert (bench["engine"], bench["requests"], bench["tokens"]) == ("hf", 12, 5)
    [sitting] = bench["sittings"]
    # Every response has exactly --tokens tokens on both sides: the same work, timed twice.
    assert sitting["engine_tokens"] == sitting["genrun_tokens"] == 12 * 5
    assert sitting["engine_seconds"] > 0 and sitting["genrun_generation_seconds"] > 0
    assert sitting["genrun_wall_seconds"] > sitting["genrun_generation_seconds"]
    # From the unrounded figures: the tokens/s fields are rounded to 0.01, coarse on a busy machine.
    genrun_rate = sitting["genrun_tokens"] / sitting["genrun_generation_seconds"]
    assert sitting["ratio"] == pytest.approx(
        genrun_rate / (sitting["engine_tokens"] / sitting["engine_seconds"]), rel=1e-3
    )
    assert bench["ratio"]["min"] <= bench["ratio"]["median"] <= bench["ratio"]["max"]
    assert "genrun/engine: median" in result.stdout and "sitting 1: engine" in result.stdout
    # Issue 46 item 1: genrun's own CPU per trajectory (its processes outside the engine) beside the ratio.
    cpu = sitting["genrun_own_cpu_us_per_trajectory"]
    assert sitting["genrun_trajectories"] == 12 and cpu > 0
    [line] = [line for line in result.stdout.splitlines() if "sitting 1: engine" in line]
    assert line.endswith(f"; genrun's own CPU outside the engine: {cpu:.0f} us per trajectory")
    assert bench["genrun_own_cpu_us_per_trajectory"] == dict.fromkeys(("median", "min", "max"), round(cpu, 3))
    assert f"genrun's own CPU outside the engine: median {cpu:.0f} us per trajectory" in result.stdout


def test_the_scratch_folder_goes_once_the_json_is_elsewhere_unless_kept(tmp_path):
    from generation_core.benchmark.command import _write_figures, parse_bench_arguments

    figures = {"sittings": [], "ratio": {"median": 1.0}}
    for extra, kept in (([], False), (["--keep"], True)):
        scratch = tmp_path / f"scratch{len(extra)}"
        scratch.mkdir()
        args, _ = parse_bench_arguments(["--json", str(tmp_path / "out.json"), *extra])
        _write_figures(args, figures, scratch)
        assert scratch.exists() == kept
        assert json.loads((tmp_path / "out.json").read_text()) == figures
    args, _ = parse_bench_arguments([])
    _write_figures(args, figures, scratch)  # no --json: the scratch folder holds the only copy
    assert json.loads((scratch / "bench.json").read_text()) == figures


# A driver that starts a shard worker and a server actor (titled as Ray titles them), each burning a known CPU time.
_BURN = "import sys, time\nend = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\n"
# The children are reaped 0.3 s after they end: the follower (a poll every 0.05 s) sees their final CPU time.
_DRIVER = f"""import os, subprocess, sys, time
children = [subprocess.Popen(["ray::" + title, "-c", {_BURN!r}, "0.3"], executable=sys.executable)
            for title in ("run_shard", "EngineServer.generate")]
exec({_BURN!r})
[os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT) for child in children]
time.sleep(0.3)
[child.wait() for child in children]
"""


@pytest.mark.timeout(60)
def test_genruns_own_cpu_is_its_processes_below_the_command_by_role_the_engines_actor_left_out():
    """Issue 46 item 1: `genrun bench`'s CPU figure follows every process below the command through
    /proc and counts the driver and shard worker, not the server actor."""
    import subprocess
    import sys

    from generation_core.benchmark.process_cpu import GENRUN_OWN_ROLES, follow

    started = time.time()
    tree = follow(subprocess.Popen([sys.executable, "-c", _DRIVER, "0.2"]), 0.05)
    assert sorted(tree.role_of(process) for process in tree.processes.values()) == [
        "driver",
        "server actor",
        "shard worker",
    ]
    # The burnt time plus each interpreter's start (hundredths of a second each).
    assert 0.5 <= tree.cpu_seconds(GENRUN_OWN_ROLES, started, time.time()) <= 1.0
    assert 0.3 <= tree.cpu_seconds(("server actor",), started, time.time()) <= 0.6


def test_a_process_cpu_between_polls_is_interpolated_and_without_proc_the_figure_says_so():
    """Issue 46 item 1: the CPU of a span is each process's CPU at its ends, linear between polls;
    where /proc cannot be read the bench prints that the figure is not available."""
    from generation_core.benchmark.command import Sitting, cpu_summary
    from generation_core.benchmark.process_cpu import Process

    process = Process(7, samples=[(10.0, 1.0), (12.0, 2.0), (14.0, 2.5)])
    assert [process.at(moment) for moment in (9.0, 10.0, 11.0, 13.0, 20.0)] == [0.0, 1.0, 1.5, 2.25, 2.5]
    assert (
        Sitting(10, 1.0, 10, 1.0, 2.0, 2, None)
        .line(1)
        .endswith(
            "genrun/engine 1.00; genrun's own CPU outside the engine: not available (it is read from Linux's /proc)"
        )
    )
    assert cpu_summary(None).startswith("genrun's own CPU outside the engine: not available")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sittings", "0"], "--sittings must be an integer >= 1"),
        (["--tokens", "many"], "usage: genrun bench"),
        (["--frobnicate"], "unknown option --frobnicate"),
        (["data.max_response_length=9"], "data.max_response_length is set by the bench (--tokens"),
        (["actor_rollout_ref.rollout.name=instant"], "no engine-side benchmark for rollout.name=instant"),
    ],
)
def test_bad_bench_arguments_are_one_line_before_anything_starts(args, message, capsys):
    from flows.cli import main

    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("genrun: error:")
