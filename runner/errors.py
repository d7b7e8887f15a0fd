"""The runner's one error type: the CLI edge turns it into a red message and exit code 1."""

from __future__ import annotations


class RunnerError(Exception):
    """A problem the user can act on; the message names it and says what to do next."""
