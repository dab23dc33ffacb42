"""interrupt.StopRequest.handling: a library caller's run (dispatch.run_in_process) hears a
Ctrl-C as `genrun` does, and leaves the process's SIGINT handling as it found it. No Ray: the
real runs are in tests/test_interrupt.py."""

import json
import os
import signal
import threading

import pytest

from generation_core.interrupt import Stopped, StopRequest
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(30)


def test_a_ctrl_c_in_the_block_asks_to_stop_and_is_forgotten_after_it(capfd):
    stop = StopRequest()
    before = signal.getsignal(signal.SIGINT)
    with stop.handling():
        signal.raise_signal(signal.SIGINT)
        assert stop.requested()
        # An interruptible stage entered after the request ends at once.
        with pytest.raises(Stopped), stop.interruptible():
            pass
    assert "genrun: stopping:" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before
    assert not stop.requested()


def test_where_the_cli_installed_it_the_block_changes_nothing():
    stop = StopRequest()
    stop.install()
    try:
        with stop.handling():
            stop.request()
        # The CLI's request outlives the run: it prints "stopped" and exits 130 after it.
        assert stop.requested()
        assert signal.getsignal(signal.SIGINT) == stop._handle
    finally:
        stop.uninstall()


def test_outside_the_main_thread_the_block_installs_nothing():
    stop = StopRequest()
    before = signal.getsignal(signal.SIGINT)
    seen = []

    def run():
        with stop.handling():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [before]


def test_quitting_at_once_kills_every_process_genrun_started_and_theirs_but_nothing_else(tmp_path):
    """What a second Ctrl-C does before it exits: a child and its own child (as Ray's raylet and
    its agents) are killed; the process itself, its parent and an unrelated process live on."""
    import subprocess
    import sys
    import time

    unrelated = subprocess.Popen(["sleep", "60"])
    script = (
        "import json, subprocess, sys, time\n"
        "from generation_core.interrupt import kill_descendants\n"
        "tree = subprocess.Popen(['sh', '-c', 'sleep 60 & echo $!; wait'], stdout=subprocess.PIPE, text=True)\n"
        "grandchild = int(tree.stdout.readline())\n"
        "killed = kill_descendants()\n"
        "tree.wait(timeout=10)\n"
        "print(json.dumps({'killed': sorted(killed), 'expected': sorted([tree.pid, grandchild]), 'grandchild': grandchild, 'child_status': tree.returncode}))\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=str(tmp_path.parent),
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert done.returncode == 0, done.stderr
        outcome = json.loads(done.stdout.strip().splitlines()[-1])
        assert outcome["killed"] == outcome["expected"] and outcome["child_status"] == -9
        grandchild = outcome["grandchild"]
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{grandchild}") and _state(grandchild) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{grandchild}") or _state(grandchild) == "Z", "the grandchild was killed too"
        assert unrelated.poll() is None, "a process genrun did not start is left alone"
    finally:
        unrelated.kill()
        unrelated.wait()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
