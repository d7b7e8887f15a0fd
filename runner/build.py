"""`dflashctl build`: plan an environment build as plain data, then apply it (Docker image or uv venv).

The image tag is content-addressed: sha256 over the Dockerfile, the chosen lock, the project source
(pyproject, README, runner/, dflash/, envs/<variant>/), the base image ref and the build arguments.
An image with that tag already on the host is the same build, so applying the plan is a no-op.
The proxy CA and the wheelhouse change how files are fetched, never what is installed (the lock's
hashes decide that), so they are sent with the context but left out of the tag.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from runner.canonical import sha256_file
from runner.envs import Variant, tomllib
from runner.errors import RunnerError
from runner.exec import docker
from runner.exec.stream import stream
from runner.fsutil import atomic_write_text
from runner.lock import check_lock, uv_binary

IMAGE_REPO = "dflash"
_SOURCE_DIRS = ("runner", "dflash")
_SKIP_PARTS = {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


@dataclass(kw_only=True, slots=True)
class BuildPlan:
    variant: str
    lock_kind: str
    lock: str
    """Lock path relative to the project root."""
    lock_sha256: str
    dockerfile: str
    base_image: str
    build_args: dict[str, str]
    labels: dict[str, str]
    fingerprint: str
    """sha256 of everything that decides the image's content; the tag carries its first 16 hex digits."""
    tag: str
    context_files: list[str]
    """Project files sent as the build context (relative paths), besides the .build/ extras."""
    ca_cert: str | None = None
    wheelhouse: str | None = None
    host: str | None = None
    network: str | None = None
    command: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclass(kw_only=True, slots=True)
class VenvPlan:
    variant: str
    lock_kind: str
    lock: str
    lock_sha256: str
    path: str
    commands: list[list[str]]
    env: dict[str, str]

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _source_files(root: Path, variant: Variant) -> list[str]:
    files = ["pyproject.toml"]
    if (root / "README.md").is_file():
        files.append("README.md")
    dirs = [root / d for d in _SOURCE_DIRS] + [variant.dir]
    for d in dirs:
        for p in sorted(d.rglob("*")):
            rel = p.relative_to(root)
            if (
                p.is_file()
                and not _SKIP_PARTS.intersection(rel.parts)
                and p.suffix != ".pyc"
                and not any(part.endswith(".egg-info") or part.startswith(".") for part in rel.parts)
            ):
                files.append(rel.as_posix())
    return files


def project_version(root: Path) -> str:
    return str(tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"])


def plan_image(
    variant: Variant,
    *,
    root: Path,
    lock_kind: str = "full",
    base_image: str | None = None,
    ca_cert: Path | None = None,
    wheelhouse: Path | None = None,
    host: str | None = None,
    network: str | None = None,
) -> BuildPlan:
    """The whole build as data; nothing runs. Raises RunnerError on a missing, stale or unsafe lock."""
    lock = check_lock(variant, lock_kind, root=root)
    dockerfile = variant.dockerfile
    if not dockerfile.is_file():
        raise RunnerError(f"{dockerfile} is missing; every variant needs its Dockerfile.<variant>")
    if ca_cert is not None and not ca_cert.is_file():
        raise RunnerError(f"--ca-cert {ca_cert}: no such file (give the PEM bundle your proxy's CA is in)")
    if wheelhouse is not None and not any(wheelhouse.glob("*.whl")):
        raise RunnerError(
            f"--wheelhouse {wheelhouse}: no .whl files there (fill it with `pip download "
            f"--no-deps --only-binary :all: --dest {wheelhouse} -r {lock.path.relative_to(root)}`)"
        )
    base = base_image or variant.base_image
    build_args = {
        "BASE_IMAGE": base,
        "VARIANT": variant.name,
        "LOCK": lock.path.name,
        "LOCK_SHA256": lock.sha256,
    }
    files = sorted({dockerfile.relative_to(root).as_posix(), *_source_files(root, variant)})
    digest = hashlib.sha256(
        json.dumps(
            {
                "files": {f: sha256_file(root / f)[0] for f in files},
                "build_args": build_args,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    kind_suffix = "" if lock_kind == "full" else f"-{lock_kind}"
    tag = f"{IMAGE_REPO}:{variant.name}{kind_suffix}-{digest[:16]}"
    labels = {
        "org.opencontainers.image.title": "dflashctl",
        "org.opencontainers.image.version": project_version(root),
        "org.opencontainers.image.base.name": base,
        "io.dflash.variant": variant.name,
        "io.dflash.lock": lock.path.name,
        "io.dflash.lock-sha256": lock.sha256,
        "io.dflash.fingerprint": digest,
    }
    if "@sha256:" in base:
        labels["org.opencontainers.image.base.digest"] = base.split("@", 1)[1]
    command = ["env", "DOCKER_BUILDKIT=0", "docker", "build", "-f", dockerfile.name, "-t", tag]
    for k, v in build_args.items():
        command += ["--build-arg", f"{k}={v}"]
    for k, v in labels.items():
        command += ["--label", f"{k}={v}"]
    if network:
        command += ["--network", network]
    command.append("-")
    return BuildPlan(
        variant=variant.name,
        lock_kind=lock_kind,
        lock=lock.path.relative_to(root).as_posix(),
        lock_sha256=lock.sha256,
        dockerfile=dockerfile.name,
        base_image=base,
        build_args=build_args,
        labels=labels,
        fingerprint=digest,
        tag=tag,
        context_files=files,
        ca_cert=str(ca_cert) if ca_cert else None,
        wheelhouse=str(wheelhouse) if wheelhouse else None,
        host=host,
        network=network,
        command=command,
    )


def _context_members(plan: BuildPlan, root: Path) -> Iterator[tuple[str, Path]]:
    for f in plan.context_files:
        yield f, root / f
    if plan.ca_cert:
        yield ".build/ca.pem", Path(plan.ca_cert)
    if plan.wheelhouse:
        for whl in sorted(Path(plan.wheelhouse).glob("*.whl")):
            yield f".build/wheelhouse/{whl.name}", whl


def write_context(plan: BuildPlan, root: Path, out: Path) -> None:
    """The build context as a tar with fixed owners and times, so equal inputs give equal bytes."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, src in _context_members(plan, root):
            info = tarfile.TarInfo(name)
            info.size = src.stat().st_size
            info.mode = 0o755 if os.access(src, os.X_OK) and src.suffix != ".pem" else 0o644
            info.mtime = 0
            with src.open("rb") as f:
                tar.addfile(info, f)


@dataclass(kw_only=True, slots=True)
class BuildResult:
    tag: str
    status: str
    """"built", or "exists" when an image with the content-addressed tag was already there (no-op)."""
    image_id: str
    labels: dict[str, str]


def verify_labels(plan: BuildPlan, labels: dict[str, str]) -> None:
    wrong = {k: (v, labels.get(k)) for k, v in plan.labels.items() if labels.get(k) != v}
    if wrong:
        detail = "; ".join(f"{k}: want {w!r}, image has {h!r}" for k, (w, h) in wrong.items())
        raise RunnerError(
            f"image {plan.tag} does not carry the planned labels ({detail}); remove it "
            f"(`docker rmi {plan.tag}`) and build again"
        )


def alias_latest(plan: BuildPlan) -> None:
    """Point `dflash:<variant>[-runner]` at this build: the name `--variant V` resolves to elsewhere
    (warm-cache, cache restore). The content-addressed tag stays the record of what was built."""
    from runner.exec.remote import run

    run(plan.host, ["docker", "tag", plan.tag, plan.tag.rsplit("-", 1)[0]])


def apply_image(plan: BuildPlan, root: Path, *, on_line: Callable[[str], None]) -> BuildResult:
    docker.ensure_engine(plan.host)
    if docker.image_exists(plan.host, plan.tag):
        labels = docker.image_labels(plan.host, plan.tag)
        verify_labels(plan, labels)
        alias_latest(plan)
        return BuildResult(
            tag=plan.tag, status="exists", image_id=docker.image_id(plan.host, plan.tag), labels=labels
        )
    with tempfile.TemporaryDirectory(prefix="dflash-build-") as tmp:
        context = Path(tmp, "context.tar")
        write_context(plan, root, context)
        docker.stream(plan.host, plan.command, stdin_path=context, on_line=on_line)
    labels = docker.image_labels(plan.host, plan.tag)
    verify_labels(plan, labels)
    alias_latest(plan)
    return BuildResult(
        tag=plan.tag, status="built", image_id=docker.image_id(plan.host, plan.tag), labels=labels
    )


def plan_venv(
    variant: Variant,
    path: Path,
    *,
    root: Path,
    lock_kind: str = "full",
    python: str | None = None,
    ca_cert: Path | None = None,
    wheelhouse: Path | None = None,
    uv: str | None = None,
) -> VenvPlan:
    """The same environment as the image, as a uv venv (hosts without Docker, such as LXC containers)."""
    lock = check_lock(variant, lock_kind, root=root)
    uv = uv or uv_binary()
    vpy = str(path / "bin" / "python")
    source = ["--offline", "--no-index", "--find-links", str(wheelhouse)] if wheelhouse else []
    commands = [
        [uv, "venv", "--no-config", "--allow-existing", "--python", python or variant.python, str(path)],
        [
            uv,
            "pip",
            "sync",
            "--no-config",
            "--python",
            vpy,
            "--require-hashes",
            "--only-binary",
            ":all:",
            *source,
            str(lock.path),
        ],
        # The build backend comes from the lock, so installing the project needs no index.
        [
            uv,
            "pip",
            "install",
            "--no-config",
            "--python",
            vpy,
            "--no-deps",
            "--no-build-isolation",
            "--offline",
            str(root),
        ],
    ]
    env = {"SSL_CERT_FILE": str(ca_cert)} if ca_cert else {}
    return VenvPlan(
        variant=variant.name,
        lock_kind=lock_kind,
        lock=lock.path.relative_to(root).as_posix(),
        lock_sha256=lock.sha256,
        path=str(path),
        commands=commands,
        env=env,
    )


def apply_venv(plan: VenvPlan, *, on_line: Callable[[str], None]) -> None:
    if (
        Path(plan.path).exists()
        and any(Path(plan.path).iterdir())
        and not Path(plan.path, "pyvenv.cfg").is_file()
    ):
        raise RunnerError(f"{plan.path} exists and is not a venv; choose an empty or new directory")
    env = {**os.environ, **plan.env}
    for argv in plan.commands:
        on_line("$ " + shlex.join(argv))
        stream(argv, on_line=on_line, env=env, what=f"`{shlex.join(argv[:3])} ...`")
    # Records which lock made this venv, so `dflashctl doctor --python` can say what it should match.
    marker = {"variant": plan.variant, "lock": plan.lock, "lock_sha256": plan.lock_sha256}
    atomic_write_text(Path(plan.path, "dflash-env.json"), json.dumps(marker, indent=2) + "\n")
