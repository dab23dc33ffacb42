"""The one exception type users see as a one-line message instead of a traceback."""


class GenrunError(Exception):
    """A problem with the user's input or environment; the message says what to fix."""


class InputChanged(GenrunError):
    """The run's input changed under it (a data file since the run was planned, a shard's rows
    since its first attempt): a retry would read the same input, so a shard task that raises it
    is not retried, and the run stops with its message (tasks/run_shard.py)."""


class BadInputRow(InputChanged):
    """A dataset row no chat template can read as it is (a null prompt or content, a template
    that raises on it), found by the shard that reads it, past preflight's sample: as with a
    changed input, a retry would read the same row, so the shard is refused, not retried."""
