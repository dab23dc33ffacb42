"""interrupt.StopRequest.handling: a library caller's run (dispatch.run_in_process) hears a
Ctrl-C as `genrun` does, and leaves the process's SIGINT handling as it found it. No Ray: the
real runs are in tests/test_interrupt.py."""

import signal
import threading

import pytest

from generation_core.interrupt import Stopped, StopRequest

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
