"""A Prefect API for one `genrun` invocation when the user has none.

Ray workers cannot use Prefect's per-process ephemeral API (each worker would start its own and
time out), so when PREFECT_API_URL is unset we start one temporary server on 127.0.0.1 before
Ray starts, export its URL (Ray workers inherit the environment), and stop it at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def prefect_api() -> Iterator[str]:
    existing = os.environ.get("PREFECT_API_URL")
    if existing:
        yield existing
        return
    from prefect.server.api.server import SubprocessASGIServer

    # A throwaway server: no telemetry, and it must never answer on anything but loopback
    # (SubprocessASGIServer binds 127.0.0.1).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    server = SubprocessASGIServer()
    server.start(timeout=120)
    os.environ["PREFECT_API_URL"] = server.api_url
    logger.info("started a temporary Prefect server at %s", server.api_url)
    try:
        yield server.api_url
    finally:
        _drain_prefect_clients()
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()


def _drain_prefect_clients() -> None:
    """Send queued logs and events while the server still listens; otherwise Prefect's
    background workers retry against a stopped server at exit for minutes."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=15)
