"""`dflashctl doctor`: fingerprint an environment from inside it, then check it against its variant.

The probe (dflash/envprobe.py, standard library only) is sent as source to the environment's own
python: a local interpreter, `docker run -i IMAGE python3 -`, or either of them over ssh. So the
runner never imports torch, and the answer is what the job will really see.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from runner.envs import Variant
from runner.errors import RunnerError
from runner.exec import docker, remote
from runner.lock import Lock, expected_packages

# Oldest driver (major version) each CUDA runtime needs; newer minors of a major use the newest entry below them.
MIN_DRIVER = {"12.8": 570, "12.9": 575, "13.0": 580}
# Installed by venv/ensurepip or by installing the project itself: not drift unless the lock pins them.
TOOLING = {"pip", "setuptools", "wheel", "dflashctl"}
LOW_DISK_BYTES = 20 * 1024**3


def probe_source() -> str:
    # find_spec of the top-level package does not import it, so dflash/__init__ never runs here.
    spec = importlib.util.find_spec("dflash")
    if spec is None or not spec.origin:
        raise RunnerError("cannot find the dflash package next to the runner; reinstall dflashctl")
    return (Path(spec.origin).parent / "envprobe.py").read_text()


def parse_probe(stdout: bytes, where: str) -> dict[str, Any]:
    return remote.parse_json_tail(stdout, f"the environment probe in {where}", "is python3 there?")


def collect(
    *,
    python: str | None = None,
    image: str | None = None,
    host: str | None = None,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The fingerprint, probed inside the environment being checked."""
    source = probe_source()
    if image:
        return parse_probe(docker.run_python_source(host, image, source, warn=warn), f"image {image}")
    interpreter = python or (sys.executable if host is None else "python3")
    out = remote.run(host, [interpreter, "-"], input=source.encode(), timeout=300).stdout
    return parse_probe(out, f"{interpreter} on {host or 'this machine'}")


@dataclass(kw_only=True, slots=True)
class Check:
    name: str
    status: str
    """ok, warn (worth knowing) or fail (breaks reproducibility or cannot run)."""
    detail: str


@dataclass(kw_only=True, slots=True)
class Drift:
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    different: list[dict[str, str]] = field(default_factory=list)
    torch_swap: str | None = None


def _same_version(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def drift(fp: dict[str, Any], lock: Lock) -> Drift:
    expected = expected_packages(lock, fp["markers"])
    installed: dict[str, str] = {str(canonicalize_name(k)): v for k, v in fp["packages"].items()}
    d = Drift()
    for name, version in sorted(expected.items()):
        if name not in installed:
            d.missing.append(f"{name}=={version}")
        elif not _same_version(installed[name], version):
            d.different.append({"name": name, "expected": version, "installed": installed[name]})
    d.extra = [f"{n}=={v}" for n, v in sorted(installed.items()) if n not in expected and n not in TOOLING]
    return d


def _torch_swap(fp: dict[str, Any], variant: Variant | None, lock: Lock | None) -> str | None:
    torch = fp.get("torch")
    pinned = None
    if lock is not None:
        pinned = expected_packages(lock, fp["markers"]).get("torch")
    if (
        pinned is None
        and variant is not None
        and (lock is None or any(e.name == "torch" for e in lock.entries))
    ):
        pinned = variant.torch
    if torch is None:
        return f"torch is not importable but the pin is torch=={pinned}" if pinned else None
    if pinned is None:
        return (
            f"torch {torch['version']} is installed but the lock has no torch" if lock is not None else None
        )
    if not _same_version(torch["version"], pinned):
        return f"torch {torch['version']} (CUDA {torch.get('cuda')}) is installed; the pin is torch=={pinned}"
    if variant is not None and torch.get("cuda") != variant.cuda:
        return f"torch {torch['version']} is built for CUDA {torch.get('cuda')}; variant {variant.name} needs {variant.cuda}"
    return None


def required_driver(cuda: str | None) -> int | None:
    if not cuda:
        return None
    if cuda in MIN_DRIVER:
        return MIN_DRIVER[cuda]
    same_major = [k for k in MIN_DRIVER if k.split(".")[0] == cuda.split(".")[0]]
    newest_below = [k for k in same_major if Version(k) <= Version(cuda)]
    return MIN_DRIVER[max(newest_below, key=Version)] if newest_below else None


def driver_check(fp: dict[str, Any], variant: Variant | None) -> Check:
    cuda = variant.cuda if variant else (fp.get("torch") or {}).get("cuda")
    need = variant.min_driver if variant else required_driver(cuda)
    have = (fp.get("driver") or {}).get("version")
    if not cuda:
        return Check(
            name="driver", status="ok", detail=f"driver {have or 'absent'}; no CUDA build to check against"
        )
    if have is None:
        status = "fail" if fp.get("gpus") else "warn"
        return Check(
            name="driver", status=status, detail=f"no NVIDIA driver visible; CUDA {cuda} needs >= {need}"
        )
    major = int(str(have).split(".")[0])
    if need is not None and major < need:
        return Check(
            name="driver",
            status="fail",
            detail=f"driver {have} is too old for CUDA {cuda} (needs >= {need}): upgrade the driver "
            "or use an older variant",
        )
    return Check(name="driver", status="ok", detail=f"driver {have} runs CUDA {cuda} (needs >= {need})")


def disk_checks(fp: dict[str, Any]) -> list[Check]:
    checks = []
    for key, path in (fp.get("paths") or {}).items():
        free = (fp.get("disk_free_bytes") or {}).get(key)
        if free is None:
            checks.append(Check(name=f"disk {key}", status="warn", detail=f"{path}: free space unknown"))
            continue
        low = free < LOW_DISK_BYTES
        checks.append(
            Check(
                name=f"disk {key}",
                status="warn" if low else "ok",
                detail=f"{path}: {free / 1024**3:.1f} GiB free"
                + (" (low: compile caches and checkpoints need room)" if low else ""),
            )
        )
    return checks


def tool_checks(fp: dict[str, Any]) -> list[Check]:
    tools = fp.get("tools") or {}
    return [
        Check(
            name=t, status="ok" if tools.get(t) else "warn", detail=tools.get(t) or f"{t} not on PATH ({why})"
        )
        for t, why in (
            ("tmux", "tmux keeps jobs alive across ssh disconnects"),
            ("docker", "needed to build and run variant images"),
        )
    ]


@dataclass(kw_only=True, slots=True)
class Report:
    target: str
    fingerprint: dict[str, Any]
    checks: list[Check]
    drift: Drift | None
    lock: str | None
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def diagnose(fp: dict[str, Any], *, target: str, variant: Variant | None, lock: Lock | None) -> Report:
    checks: list[Check] = []
    d = None
    if lock is not None:
        d = drift(fp, lock)
        for name in d.missing:
            checks.append(
                Check(name="missing", status="fail", detail=f"{name} is in the lock but not installed")
            )
        for diff in d.different:
            checks.append(
                Check(
                    name="different",
                    status="fail",
                    detail=f"{diff['name']} {diff['installed']} is installed; the lock pins {diff['expected']}",
                )
            )
        for name in d.extra:
            checks.append(
                Check(name="extra", status="fail", detail=f"{name} is installed but not in the lock")
            )
        if not (d.missing or d.different or d.extra):
            checks.append(Check(name="lock", status="ok", detail=f"every package matches {lock.path.name}"))
    swap = _torch_swap(fp, variant, lock) if (variant or lock) else None
    if d is not None:
        d.torch_swap = swap
    if swap:
        checks.insert(0, Check(name="TORCH SWAP", status="fail", detail=swap))
    torch = fp.get("torch")
    if torch is None and any("torch:" in e for e in fp.get("errors", [])):
        checks.append(Check(name="torch", status="fail", detail="torch is installed but does not import"))
    checks.append(driver_check(fp, variant))
    checks += disk_checks(fp)
    checks += tool_checks(fp)
    return Report(
        target=target,
        fingerprint=fp,
        checks=checks,
        drift=d,
        lock=str(lock.path) if lock else None,
        ok=not any(c.status == "fail" for c in checks),
    )
