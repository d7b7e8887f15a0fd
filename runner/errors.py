"""The runner's error types: the CLI edge (runner.console.cli_errors) prints one red message and
exits with the error's exit_code.

Exit codes of every dflashctl verb: 0 done; 1 the request was well formed but could not be carried
out here (a host that does not answer, a missing tool, a lookup that found nothing, a held lock, an
environment that does not match); 2 the input was refused (a malformed argument, host string or
config value, a path of the wrong kind, a broken, unsafe or untrusted cache-store entry): fix the
input, since retrying as is cannot help. click's own usage errors are 2 as well. Verbs that report
a verdict add their own codes above these: doctor 3 (drift), watch --once (its findings).
"""

from __future__ import annotations


class RunnerError(Exception):
    """A problem the user can act on; the message names it and says what to do next."""

    exit_code = 1


class BadInput(RunnerError):
    """What the user gave is malformed, unsafe or untrusted; the message names it and what is allowed."""

    exit_code = 2
