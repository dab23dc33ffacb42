"""The run's progress numbers (done / total, rate, ETA, failures) from the shard jobs' reports
(shard/progress.py, shard/progress_board.py, driver/run_progress.py), and the display: a line
redrawn in place on a terminal, log lines above it, a plain log line every N seconds elsewhere.
No Ray, no Prefect: the real run is tests/test_interrupt.py."""

import asyncio
import io
import logging
import re
import time

import pytest

from generation_core.console import ProgressDisplay
from generation_core.driver.run_progress import RunProgress
from generation_core.inputs.shard_rows import ShardSpec
from generation_core.shard.eta import format_seconds
from generation_core.shard.progress import ShardReport, ShardReporter
from generation_core.shard.progress_board import ProgressBoard

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _shards():
    return [ShardSpec(shard_id=0, start=0, end=50), ShardSpec(shard_id=1, start=50, end=100)]


def _report(shard_id, *, start=0, generated=0, failed=0, owed=100, attempt="a"):
    return ShardReport(
        shard_id=shard_id,
        attempt=f"{attempt}{shard_id}",
        committed_at_start=start,
        owed=owed,
        generated=generated,
        failed=failed,
    )


def test_done_total_rate_and_eta_across_shards():
    clock = Clock()
    progress = RunProgress(_shards(), rollout_n=2, clock=clock)
    # An earlier run committed 30 in shard 1; nobody has reported yet.
    progress.set_baseline({0: 0, 1: 30})
    totals = progress.totals()
    assert (totals.done, totals.total, totals.rate, totals.eta) == (30, 200, None, None)

    board = ProgressBoard()
    # Workers start: nothing generated for 20 s (the rate ignores that wait).
    for _ in range(20):
        clock.now += 1
        progress.update(board.snapshot())
    board.report(vars(_report(0)))
    board.report(vars(_report(1, start=30)))
    for second in range(1, 11):
        clock.now += 1
        board.report(vars(_report(0, generated=5 * second, failed=1)))
        board.report(vars(_report(1, start=30, generated=5 * second)))
        progress.update(board.snapshot())
    totals = progress.totals()
    assert totals.done == 130 and totals.failed == 1 and totals.total == 200
    assert totals.rate == pytest.approx(10.0)
    # The run's 69 left at its 10/s would take 6.9 s, but shard 0 alone has 49 left at its own
    # 5/s (45 in the 9 s since its first report): the ETA is the later of the two (shard/eta.py).
    assert totals.eta == pytest.approx((100 - 50 - 1) / 5.0)
    assert totals.line() == "trajectories 130/200 (65.5%), 10.0/s, ETA 10s, 1 failed, shards 0/2 done"

    # A shard's manifest is the last word (prompts too long for the model were not owed).
    progress.shard_finished(0, done=96, failed=0, expected=96)
    progress.shard_finished(1, done=100, failed=0, expected=100)
    totals = progress.totals()
    assert (totals.done, totals.total, totals.percent, totals.shards_done) == (196, 196, 100.0, 2)
    assert totals.line().startswith("trajectories 196/196 (100.0%), ")


def test_the_closing_line_gives_the_whole_runs_average_beside_the_whole_time():
    """Issue 51 item 2: "0.2/s in 4m40s" paired the last minute's rate with the whole time."""
    clock = Clock()
    progress = RunProgress(_shards()[:1], rollout_n=2, clock=clock)
    board = ProgressBoard()
    board.report(vars(_report(0)))
    progress.update(board.snapshot())
    # 80 in the first 200 s, then only 16 in the last 80 s: the last minute's rate is 0.2/s.
    for second in range(1, 281):
        clock.now += 1
        generated = second * 80 // 200 if second <= 200 else 80 + (second - 200) // 5
        board.report(vars(_report(0, generated=generated)))
        progress.update(board.snapshot())
    progress.shard_finished(0, done=96, failed=0, expected=96)
    totals = progress.totals()
    assert totals.rate == pytest.approx(0.2, abs=0.02)
    assert totals.line() == "trajectories 96/96 (100.0%), 0.34/s on average over 4m40s, 0 failed, shards 1/1 done"


def test_an_adaptive_run_says_what_it_drew_and_what_it_did_not_need():
    """Issue 51 item 2: "26/26" read as if the 22 samples adaptive sampling decided against never existed."""
    clock = Clock()
    progress = RunProgress([ShardSpec(shard_id=0, start=0, end=12)], rollout_n=4, clock=clock)
    clock.now += 100
    progress.shard_finished(0, done=26, failed=0, expected=26, not_needed=22)
    totals = progress.totals()
    assert totals.not_needed == 22
    assert totals.line() == (
        "trajectories 26/26 drawn (100.0%), 22 not needed (adaptive sampling), in 1m40s, 0 failed, shards 1/1 done"
    )


def test_a_resumed_run_says_up_front_what_is_committed_already():
    """Issue 51 item 2: the first progress line of a resume came minutes in, already at 24/32."""
    progress = RunProgress(_shards(), rollout_n=2)
    progress.set_baseline({0: 0, 1: 0})
    assert progress.resume_line() is None
    progress.set_baseline({0: 18, 1: 0})
    assert progress.resume_line() == (
        "resuming: 18 of 200 trajectories already committed in this folder (kept; only the others are generated)"
    )


def test_a_retried_attempt_adds_to_the_rate_and_restarts_from_its_commits():
    clock = Clock()
    progress = RunProgress(_shards()[:1], rollout_n=2, clock=clock)
    board = ProgressBoard()
    board.report(vars(_report(0, generated=40, attempt="first")))
    clock.now += 10
    progress.update(board.snapshot())
    # The first attempt died with 30 committed; the retry starts from them.
    board.report(vars(_report(0, start=30, generated=20, attempt="second")))
    clock.now += 10
    progress.update(board.snapshot())
    totals = progress.totals()
    assert totals.done == 50 and totals.generated == 60


def test_a_reporter_without_a_board_counts_and_never_stops():
    reporter = ShardReporter(None, 3)
    assert not reporter.attached and not reporter.stop_requested_now()

    async def run():
        async with reporter.reporting():
            reporter.report.generated += 1

    asyncio.run(run())
    assert reporter.report.generated == 1 and not reporter.stop


def test_the_board_passes_the_stop_request_with_its_answers():
    board = ProgressBoard()
    assert board.report(vars(_report(0)))["stop"] is False
    board.request_stop()
    assert board.report(vars(_report(0, generated=1)))["stop"] is True and board.stop_requested(0)


def test_the_stop_request_answers_the_shards_whose_jobs_started_and_later_jobs_stop_before_generating():
    """The driver cancels only the jobs `request_stop` does not name: a job that has started
    commits what finished itself (a cancelled one would lose it), whether or not its first
    report has reached the board yet."""
    board = ProgressBoard()
    assert board.stop_requested(0) is False  # shard 0's job starts; no report yet
    assert board.stop_requested(2) is False
    board.report(vars(_report(2, generated=3)))
    assert board.request_stop() == [0, 2]
    # Shard 1's job starts after the request: it is told to stop before it generates.
    assert board.stop_requested(1) is True
    assert board.request_stop() == [0, 1, 2]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_the_line_is_redrawn_in_place_and_log_lines_go_above_it(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    stream = _Terminal()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with ProgressDisplay(stream=stream, redraw=0) as display:
            display.show("trajectories 1/10")
            display.show("trajectories 2/10")
            logging.getLogger("generation_core.test").warning("a warning")
            display.close("trajectories 10/10")
    finally:
        root.removeHandler(handler)
    assert stream.getvalue() == (
        "trajectories 1/10\r\x1b[Ktrajectories 2/10\r\x1b[Ka warning\ntrajectories 2/10\r\x1b[Ktrajectories 10/10\n"
    )
    assert handler.stream is stream


def test_elsewhere_a_plain_line_every_interval(caplog):
    stream = io.StringIO()
    display = ProgressDisplay(stream=stream, interval=3600)
    with caplog.at_level(logging.INFO, logger="generation_core.console"):
        display.show("trajectories 1/10")
        display.show("trajectories 2/10")  # within the interval: not logged
        display.close("trajectories 10/10")
    assert [r.getMessage() for r in caplog.records] == ["trajectories 1/10", "trajectories 10/10"]
    assert stream.getvalue() == ""


def test_while_replicas_start_the_line_says_so_and_for_how_long(caplog):
    """Issue 45 item 5: no silent minute between the engine's announcement and the first
    progress line: while the body runs (the replicas booting) the line names what is starting
    and how long it has taken."""
    display = ProgressDisplay(stream=io.StringIO(), interval=0)
    with caplog.at_level(logging.INFO, logger="generation_core.console"):
        with display.while_waiting("starting 1 hf replica(s) on the CPU", every=0.01):
            deadline = time.monotonic() + 60
            while len(caplog.records) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        shown = len(caplog.records)
        time.sleep(0.05)
    assert shown >= 2 and all(
        re.fullmatch(r"starting 1 hf replica\(s\) on the CPU \(\d+ s\)", r.getMessage()) for r in caplog.records
    )
    assert len(caplog.records) == shown, "the line stops with the body"


def test_disabled_shows_nothing(caplog):
    stream = _Terminal()
    with caplog.at_level(logging.INFO), ProgressDisplay(stream=stream, enabled=False) as display:
        display.show("trajectories 1/10")
        display.close("done")
    assert stream.getvalue() == "" and not caplog.records


def test_seconds_read_as_a_person_reads_them():
    assert [format_seconds(s) for s in (7, 75, 3600 * 26 + 120, None)] == ["7s", "1m15s", "26h02m", "-"]


def test_a_library_logging_a_genrun_error_prints_no_traceback_on_the_terminal():
    """Prefect logs a flow's exception with its traceback; the command prints a GenrunError itself,
    in one line, so the terminal shows that line only. Other errors keep their traceback."""
    from generation_core.console import _OwnLinesFilter
    from generation_core.errors import GenrunError

    def record(name: str, error: BaseException) -> logging.LogRecord:
        try:
            raise error
        except BaseException as raised:
            exc_info = (type(raised), raised, raised.__traceback__)
        return logging.LogRecord(
            name, logging.ERROR, __file__, 1, "Encountered exception during execution", None, exc_info
        )

    wrapped = RuntimeError("task failed")
    wrapped.__cause__ = GenrunError("the Ray cluster has 0 GPUs")
    shown = _OwnLinesFilter().filter
    assert not shown(record("prefect.flow_runs", GenrunError("the Ray cluster has 0 GPUs")))
    assert not shown(record("prefect.task_runs", wrapped))
    assert shown(record("prefect.flow_runs", ValueError("a bug")))
    assert shown(record("genrun", GenrunError("logged by genrun itself")))


def test_the_board_shares_the_runs_in_flight_budget_among_the_shard_jobs_still_generating():
    import time

    from generation_core.shard.progress_board import STALE_SECONDS

    board = ProgressBoard()
    shares = [board.report(vars(_report(shard)))["share"] for shard in range(4)]
    assert shares == [1.0, 1.0, 1.0, 1.0], "while every job has its shard: its own max_inflight"
    board.report(dict(vars(_report(0)), ended=True))
    board.report(dict(vars(_report(1)), ended=True))
    # Two of the four at the peak ended and nothing took their workers: the two left share it.
    assert board.report(vars(_report(2, generated=5)))["share"] == 2.0
    # A job whose worker died stops reporting; once its last report is stale (on the board's own
    # clock: workers' clocks may differ) it no longer counts.
    board.heard[3] = time.time() - STALE_SECONDS - 1
    assert board.report(vars(_report(2, generated=7)))["share"] == 4.0
    # A new shard's job starts on a freed worker: the share goes back down.
    assert board.report(vars(_report(4)))["share"] == 2.0
