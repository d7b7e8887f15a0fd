"""Errors of the compile-cache store. All are RunnerError, so the CLI edge prints them in red."""

from __future__ import annotations

from runner.errors import RunnerError


class ArtifactError(RunnerError):
    """An artifact is missing, malformed or unknown."""


class IntegrityError(ArtifactError):
    """Bytes do not match the hashes the manifest promises (tampered, truncated or corrupt)."""


class UnsafeArchiveError(ArtifactError):
    """The archive holds a member that could write outside the destination or is not a plain file."""


class UntrustedArtifactError(ArtifactError):
    """An artifact from outside this store is unsigned or wrongly signed."""


class FingerprintMismatchError(ArtifactError):
    """The artifact was compiled for a different environment or job configuration."""

    def __init__(self, message: str, differences: list[tuple[str, object, object]]) -> None:
        self.differences = differences
        super().__init__(message)
