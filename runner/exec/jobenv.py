"""Where job-side commands run: a python on this machine or a host, or a container image.

warm-cache and restore's fingerprint check both run job entry points (`python -m dflash.<x>`) in
the environment that will use the cache, never in dflashctl's own (which has no torch).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

from runner.errors import RunnerError
from runner.exec import remote
from runner.exec.remote import parse_json_tail


def job_image(image: str | None, variant: str | None) -> str | None:
    """The image a job environment runs in: --image as given, or for --variant V the image
    `dflashctl build --variant V` tags (dflash:<V>, its newest build); None for neither."""
    if image and variant:
        raise RunnerError("pass --image or --variant, not both")
    if variant:
        from runner.envs import load_variant

        return f"dflash:{load_variant(variant).name}"
    return image


@dataclass(kw_only=True, slots=True)
class JobEnv:
    python: str = "python3"
    """Interpreter on the host, or inside the image when image is set."""
    host: str | None = None
    image: str | None = None
    gpus: bool = False
    """docker run --gpus all (CUDA jobs in an image)."""
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)
    """(host path, container path, read_only) for image runs."""

    def argv(self, module_args: list[str]) -> list[str]:
        """The argv, for this machine or for runner.exec.remote's host, that runs `python -m ...`."""
        if self.image is None:
            return [self.python, "-m", *module_args]
        argv = ["docker", "run", "--rm", "-i", "--user", f"{os.getuid()}:{os.getgid()}"]
        if self.gpus:
            argv += ["--gpus", "all"]
        for src, dst, ro in self.mounts:
            argv += ["-v", f"{src}:{dst}" + (":ro" if ro else "")]
        return [*argv, self.image, self.python, "-m", *module_args]

    def describe(self) -> str:
        where = f" on {self.host}" if self.host else ""
        return (f"image {self.image}" if self.image else self.python) + where


def job_fingerprint(
    env: JobEnv, *, config: str | None, sets: list[str] | None = None, device: str | None = None
) -> dict:
    """{key, fingerprint} from `python -m dflash.fingerprint` in the target environment.

    Without a config only the environment and source parts are reported (and compared)."""
    args = ["dflash.fingerprint", "--json"]
    if config:
        args.append(config)
    elif device in ("cpu", "cuda"):
        args += ["--device", device]
    for s in sets or []:
        args += ["--set", s]
    proc = remote.run(env.host, env.argv(args), timeout=600)
    result = parse_json_tail(
        proc.stdout, f"`{shlex.join(env.argv(args))}`", "is dflash installed in that environment?"
    )
    if not isinstance(result.get("fingerprint"), dict):
        raise RunnerError(
            "dflash.fingerprint returned no fingerprint object; dflash there is too old or broken"
        )
    return result
