"""The one exception type users see as a one-line message instead of a traceback."""


class GenrunError(Exception):
    """A problem with the user's input or environment; the message says what to fix."""
