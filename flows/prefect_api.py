"""A Prefect API for one `genrun` invocation when the user has none.

Ray workers cannot use Prefect's per-process ephemeral API (each worker would start its own and
time out), so when PREFECT_API_URL is unset genrun starts one temporary server on 127.0.0.1: the
process Prefect's `SubprocessASGIServer` starts (uvicorn over `prefect.server.api.server:create_app`,
the UI off), launched here without importing Prefect's server into this process. It is launched as
soon as the light input checks pass and awaited only where the flow needs it: its start takes
seconds of its own CPU, which the rest of the checks, the engine stack's imports and Ray's start
spend beside it. Its URL is exported at the launch (Ray's workers inherit the environment). It
starts with SIGINT blocked: a Ctrl-C in the terminal reaches the whole process group, and the
server must outlive it until the flow run is marked Cancelled (a second Ctrl-C kills it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from generation_core.console import machine_load
from generation_core.errors import GenrunError
from generation_core.interrupt import STOP, sigint_blocked

logger = logging.getLogger(__name__)

# How long the temporary server gets to answer: it starts in seconds on a quiet machine, and in a
# minute or more where the load is many times the cores.
READY_SECONDS = 300.0
# uvicorn's exit status when it cannot start (a port taken between choosing and binding).
UVICORN_STARTUP_FAILURE = 3


class TemporaryPrefectServer:
    """The temporary server's process: `launch` starts it, `wait_ready` waits until it answers,
    `stop` ends it."""

    def __init__(self, process: subprocess.Popen, port: int):
        self.process: subprocess.Popen | None = process
        self.port = port

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @classmethod
    def launch(cls) -> TemporaryPrefectServer:
        """Start the server's process (it answers seconds later) and export its URL."""
        # A throwaway server: no telemetry, the UI off, and nothing but loopback.
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        port = _free_port()
        environment = {
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
        }
        command = [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app"]
        command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"]
        # Blocked only for the launch: a Ctrl-C meanwhile is delivered to this process right after.
        with sigint_blocked():
            process = subprocess.Popen(command, env=environment)
        server = cls(process, port)
        os.environ["PREFECT_API_URL"] = server.api_url
        return server

    def wait_ready(self, timeout: float = READY_SECONDS) -> str:
        """The API URL once the server answers its health check (or at once after a Ctrl-C: the
        run stops before its flow); a GenrunError when the server's process ends first or it does
        not answer within `timeout` seconds."""
        import httpx

        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while not STOP.requested():
                assert self.process is not None, "stopped"
                code = self.process.poll()
                if code is not None:
                    raise GenrunError(_exited(code, self.port))
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise GenrunError(_not_answering(timeout))
                time.sleep(0.1)
        logger.debug("the temporary Prefect server answers at %s", self.api_url)
        return self.api_url

    def stop(self) -> None:
        """End the server (SIGTERM, SIGKILL after 5 s) and take its URL out of the environment."""
        if os.environ.get("PREFECT_API_URL") == self.api_url:
            del os.environ["PREFECT_API_URL"]
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def kill(self) -> None:
        """At once, without waiting (a second Ctrl-C)."""
        if self.process is not None:
            self.process.kill()


@contextlib.contextmanager
def prefect_api(server: TemporaryPrefectServer | None) -> Iterator[None]:
    """While the flow runs on the API: the temporary `server` (None: the user's API) dies at once on
    a second Ctrl-C; on the way out its queued logs and events are sent while it still listens,
    and it stops."""
    if server is None:
        yield
        return
    forget = STOP.on_hard_exit(server.kill)
    try:
        try:
            yield
        finally:
            _drain_prefect_clients()
    finally:
        server.stop()
        forget()


def _free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the system's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _exited(code: int, port: int) -> str:
    if code == UVICORN_STARTUP_FAILURE:
        return f"the temporary Prefect server could not start on 127.0.0.1:{port} (its output above says why); run the command again"
    return f"the temporary Prefect server exited with status {code} before answering (its output above says why); run the command again"


def _not_answering(timeout: float) -> str:
    load, cpus = machine_load()
    return (
        f"the temporary Prefect server did not answer within {timeout:.0f} s (load {load:.1f} on {cpus} "
        "CPU(s)); run the command again when the machine is less busy, or start a server (infra/prefect_server.sh) "
        "and set PREFECT_API_URL (docs/prefect.md)"
    )


def _drain_prefect_clients() -> None:
    """Send queued logs and events while the server still listens; otherwise Prefect's
    background workers retry against a stopped server at exit for minutes."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=15)
