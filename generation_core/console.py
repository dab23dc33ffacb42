"""What `genrun` prints: a few lines at the default level, everything at GENRUN_LOG_LEVEL=DEBUG.

At the default level (INFO) the terminal gets genrun's own log lines (what runs where, the
merge, warnings), one progress display and the summary. Libraries' INFO lines (Prefect's flow
and task states and its hint about dedicated servers, Ray's startup lines, the replica
manager's prints, Python warnings) go only to the DEBUG output; their warnings and errors still
show. Ray workers' stdout and stderr reach the terminal only at DEBUG (`log_to_driver`,
ray_setup.py).

The progress display is one live line in a terminal (redrawn in place, log lines printed above
it) and a plain log line every `interval` seconds otherwise (CI logs, a deployment's worker).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator

from generation_core.errors import GenrunError

logger = logging.getLogger(__name__)

LOG_LEVEL_ENV = "GENRUN_LOG_LEVEL"
OWN_LOGGERS = ("generation_core", "flows", "tasks", "genrun", "__main__")
"""Loggers whose INFO lines a person sees; every other logger shows WARNING and above."""
QUIET_AT_ANY_LEVEL = {
    # verl wires a tokenizer per sample and logs its choice (and a fallback warning) each time.
    "verl.utils.tokenizer.continuous_token_wiring": logging.ERROR,
}
CHATTY_LIBRARIES = ("httpx", "httpcore", "datasets", "filelock", "urllib3", "fsspec", "s3fs", "botocore", "asyncio")
"""Libraries whose DEBUG lines would drown genrun's own even at GENRUN_LOG_LEVEL=DEBUG."""


def machine_load() -> tuple[float, int]:
    """(1-minute load average, CPUs): what the start-up lines and refusals name when a machine is busy
    (the load is nan where the platform has no load average)."""
    return (os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")), os.cpu_count() or 1


def log_level() -> int:
    name = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    level = logging.getLevelName(name)
    return level if isinstance(level, int) else logging.INFO


def debug_output() -> bool:
    """Whether everything goes to the terminal (GENRUN_LOG_LEVEL=DEBUG, or GENRUN_DEBUG=1)."""
    return log_level() <= logging.DEBUG or os.environ.get("GENRUN_DEBUG") == "1"


def _carries_genrun_error(record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, GenrunError):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


class _OwnLinesFilter(logging.Filter):
    """INFO and below from genrun's own loggers; WARNING and above from every logger, except a
    library's report of a GenrunError (Prefect logs a flow's exception with its traceback): the
    command prints that error itself, in one line, as it ends."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            own = record.name.split(".")[0] in OWN_LOGGERS
            return record.name != "py.warnings" and (own or not _carries_genrun_error(record))
        return record.name.split(".")[0] in OWN_LOGGERS


class _ShortFormatter(logging.Formatter):
    """`HH:MM:SS message` for INFO; the level (and the logger) for warnings and errors."""

    def __init__(self) -> None:
        super().__init__(datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        self._style._fmt = (
            "%(asctime)s %(message)s"
            if record.levelno < logging.WARNING
            else "%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        return super().format(record)


class StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a line is logged, not the stream of the moment
    logging was set up: a caller that swaps stderr (pytest's capture, a redirect) and closes the
    old one must not leave logging writing to a closed file. Its name must not start with "_":
    Prefect's logging setup keeps the root logger's handlers only when one of them looks like the
    user's (prefect/logging/configuration.py), and without that its INFO lines reach the terminal."""

    _chosen = None  # a stream set on purpose (the progress display's wrapper); None: sys.stderr

    @property
    def stream(self):
        return self._chosen if self._chosen is not None else sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        self._chosen = None if value is None or value is sys.stderr else value


def setup_logging() -> None:
    """Configure the terminal's log output once, before Prefect or Ray is imported."""
    level = log_level()
    verbose = debug_output()
    # Filtered at the handler, not by lowering libraries' levels: Prefect's flow-run logs still
    # reach its API (the UI), and Prefect leaves a root logger with a handler of ours alone.
    handler = StderrHandler()
    if verbose:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(_ShortFormatter())
        handler.addFilter(_OwnLinesFilter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(True)
    for name in CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, quiet_level in QUIET_AT_ANY_LEVEL.items():
        logging.getLogger(name).setLevel(quiet_level)


@contextlib.contextmanager
def prints_to_debug_log(name: str) -> Iterator[None]:
    """Lines a library prints on stdout (verl's replica manager: "LLMServerManager: [...]") go
    to the DEBUG log of `name` instead, unless the output is verbose."""
    if debug_output():
        yield
        return
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        for line in captured.getvalue().splitlines():
            if line.strip():
                logging.getLogger(name).debug("%s", line)


class _StatusAwareStream:
    """The log handler's stream while a live line is shown: each write clears the line first,
    each finished line puts it back under what was written."""

    def __init__(self, stream, display: ProgressDisplay):
        self.stream, self.display = stream, display

    def write(self, text: str) -> int:
        with self.display.lock:
            self.display._clear()
            written = self.stream.write(text)
            if text.endswith("\n"):
                self.display._draw()
            return written

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


class ProgressDisplay:
    """One progress line: redrawn in place on a terminal (at most every `redraw` seconds), or
    logged every `interval` seconds when the output is not a terminal. Disabled: silent."""

    def __init__(self, *, enabled: bool = True, interval: float = 30.0, redraw: float = 0.5, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.live = enabled and _is_terminal(self.stream)
        self.interval, self.redraw = interval, redraw
        self.lock = threading.RLock()
        self.line = ""
        self.shown = False
        self.last = float("-inf")
        self._wrapped: list[tuple[logging.StreamHandler, object]] = []

    def __enter__(self) -> ProgressDisplay:
        if self.live:
            # Log lines printed while the line is shown go above it.
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is self.stream:
                    self._wrapped.append((handler, handler.stream))
                    handler.setStream(_StatusAwareStream(self.stream, self))
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def show(self, line: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < (self.redraw if self.live else self.interval)):
            return
        self.last = now
        with self.lock:
            self.line = line
            if self.live:
                self._clear()
                self._draw()
            else:
                logger.info("%s", line)

    def log(self, line: str) -> None:
        """`line` as a log line that stays (in a terminal, above the live line); where the output is
        a log, it counts as the display's last line: the next comes `interval` seconds later."""
        logger.info("%s", line)
        self.last = time.monotonic()

    def close(self, final: str | None = None) -> None:
        """Stop redrawing; `final` stays on the screen (or is logged) as the last state."""
        with self.lock:
            if self.live:
                self._clear()
                for handler, stream in self._wrapped:
                    handler.setStream(stream)
                self._wrapped.clear()
                self.live = False
                if final and self.enabled:
                    self.stream.write(final + "\n")
                    self.stream.flush()
            elif final and self.enabled:
                logger.info("%s", final)
            self.enabled = False

    @contextlib.contextmanager
    def while_waiting(self, what: str, every: float = 1.0) -> Iterator[None]:
        """While the body runs (replicas starting: a model loading, an engine compiling), the line
        says `what` and for how long, so a minute of start-up is never a silent minute."""
        started, done = time.monotonic(), threading.Event()

        def tick() -> None:
            while not done.wait(every):
                self.show(f"{what} ({time.monotonic() - started:.0f} s)")

        thread = threading.Thread(target=tick, name="genrun-waiting-line", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def clear(self) -> None:
        """Take the line off the screen for a moment (a message written by other means)."""
        with self.lock:
            self._clear()

    def _clear(self) -> None:
        if self.live and self.shown:
            self.stream.write("\r\x1b[K")
            self.shown = False

    def _draw(self) -> None:
        if self.live and self.line and not self.shown:
            # A line wider than the terminal would wrap, and only its last row be redrawn.
            width = shutil.get_terminal_size((120, 24)).columns - 1
            self.stream.write(self.line if len(self.line) <= width else self.line[: max(width - 3, 0)] + "...")
            self.stream.flush()
            self.shown = True


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False
