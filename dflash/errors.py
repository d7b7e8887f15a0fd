"""The job's one error type. Messages say what went wrong and what to do next."""

from __future__ import annotations


class DFlashError(Exception):
    """Any error the job reports to its user (bad config, bad data, degraded kernels...)."""


class ConfigError(DFlashError, ValueError):
    """A configuration key with a bad or unknown value; `key` is the dotted path."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"config: {key}: {problem}")


class DegradedKernelError(DFlashError):
    """A kernel fell back to a slow path while strict_kernels is on."""


class DoesNotFit(DFlashError):
    """A process that shares a GPU with a running job found no room there (dflash.eval --headroom-gb):
    it exits with EXIT_CODE, which the job reads as "skip", not as a failure."""

    EXIT_CODE = 3
