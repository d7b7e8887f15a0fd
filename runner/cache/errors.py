"""Errors of the compile-cache store. All are RunnerError, so the CLI edge prints them in red; the
ones that refuse what the user pointed at (a broken, unsafe, tampered or untrusted artifact) are
also BadInput (exit code 2); a missing artifact or a fingerprint that differs from the destination
is exit code 1."""

from __future__ import annotations

from runner.errors import BadInput, RunnerError


class ArtifactError(RunnerError):
    """An artifact is missing, unknown or of another format version."""


class StoreInputError(ArtifactError, BadInput):
    """An argument about the store is malformed: a key or prefix, an age, a count, the store path."""


class BrokenArtifactError(ArtifactError, BadInput):
    """A store entry is not a readable artifact: its manifest is missing, unreadable or malformed,
    or belongs to another key than its directory's name."""


class IntegrityError(ArtifactError, BadInput):
    """Bytes do not match the hashes the manifest promises (tampered, truncated or corrupt)."""


class UnsafeArchiveError(ArtifactError, BadInput):
    """The archive holds a member that could write outside the destination or is not a plain file."""


class UntrustedArtifactError(ArtifactError, BadInput):
    """An artifact from outside this store is unsigned or wrongly signed."""


class ArtifactExistsError(ArtifactError, BadInput):
    """An artifact of this key is in the local store already, and the caller did not ask to replace it."""

    def __init__(self, key: str, path: object) -> None:
        self.key = key
        super().__init__(
            f"artifact {key[:16]} is already in the local store ({path}); pulling would replace it: "
            "pass --force to replace it with the remote one"
        )


class FingerprintMismatchError(ArtifactError):
    """The artifact was compiled for a different environment or job configuration."""

    def __init__(self, message: str, differences: list[tuple[str, object, object]]) -> None:
        self.differences = differences
        super().__init__(message)
