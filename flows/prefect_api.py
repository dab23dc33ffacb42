"""A Prefect API for one `genrun` invocation when the user has none.

Ray workers cannot use Prefect's per-process ephemeral API (each worker would start its own and
time out), so when PREFECT_API_URL is unset we start one temporary server on 127.0.0.1 before
Ray starts, export its URL (Ray workers inherit the environment), and stop it at the end. It
starts with SIGINT blocked: a Ctrl-C in the terminal reaches the whole process group, and the
server must outlive it until the flow run is marked Cancelled (a second Ctrl-C kills it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator

from generation_core.errors import GenrunError
from generation_core.interrupt import STOP, sigint_blocked

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def prefect_api(alongside: Callable[[], None] | None = None) -> Iterator[str]:
    """The Prefect API URL for this invocation. `alongside` runs while a temporary server
    starts (both take seconds of mostly separate work), with PREFECT_API_URL already set."""
    existing = os.environ.get("PREFECT_API_URL")
    if existing:
        if alongside is not None:
            alongside()
        yield existing
        return
    from prefect.server.api.server import SubprocessASGIServer

    # A throwaway server: no telemetry, and it must never answer on anything but loopback
    # (SubprocessASGIServer binds 127.0.0.1).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    server = SubprocessASGIServer()
    # The port is fixed before the start, so the URL can be exported to what starts alongside.
    server.port = server.find_available_port()
    os.environ["PREFECT_API_URL"] = url = server.api_url
    failure: list[BaseException] = []

    def start() -> None:
        try:
            with sigint_blocked():
                server.start(timeout=120)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)

    starter = threading.Thread(target=start, name="prefect-server-start", daemon=True)
    starter.start()
    try:
        if alongside is not None:
            alongside()
    except BaseException:
        # What started alongside failed (Ray on a loaded machine): nothing else would stop the server.
        starter.join()
        server.stop()
        os.environ.pop("PREFECT_API_URL", None)
        raise
    starter.join()
    if failure:
        server.stop()  # a start that timed out may have left its process
        os.environ.pop("PREFECT_API_URL", None)
        raise failure[0]
    if server.api_url != url:
        # The port was taken between choosing and binding; what started alongside has the old URL.
        server.stop()
        os.environ.pop("PREFECT_API_URL", None)
        raise GenrunError(f"the temporary Prefect server could not bind {url}; run the command again")
    logger.debug("started a temporary Prefect server at %s", server.api_url)
    process = server.server_process
    forget = STOP.on_hard_exit(lambda: process.kill() if process is not None else None)
    try:
        yield server.api_url
    finally:
        _drain_prefect_clients()
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()
        forget()


def _drain_prefect_clients() -> None:
    """Send queued logs and events while the server still listens; otherwise Prefect's
    background workers retry against a stopped server at exit for minutes."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=15)
