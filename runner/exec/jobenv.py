"""Where job-side commands run: a python on this machine or a host, or a container image.

warm-cache and restore's fingerprint check both run job entry points (`python -m dflash.<x>`) in
the environment that will use the cache, never in dflashctl's own (which has no torch).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from runner.errors import BadInput, RunnerError
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


REFUSAL_CODE = 2
"""dflash's entry points exit 2 on bad input (a config, data, a plan that does not fit), with one
`error: ...` line on stderr per problem: the refusal the runner passes on as its own."""


def job_refusal(returncode: int, stderr: bytes | str) -> list[str]:
    """The job's own refusal lines, found among whatever else the interpreter printed as it exited
    (triton's nanobind prints hundreds of 'leaked' lines after dflash.warm's one error line)."""
    if returncode != REFUSAL_CODE:
        return []
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    return [line.removeprefix("error:").strip() for line in text.splitlines() if line.startswith("error: ")]


def refused(entry: str, env: JobEnv, config: str | Path, problems: list[str]) -> BadInput:
    return BadInput(
        f"the job ({entry} in {env.describe()}) refused the config {config}:\n  "
        + "\n  ".join(problems)
        + "\nchange the config or pass --set, or run it where its devices and paths are"
    )


@contextlib.contextmanager
def config_in_env(config: Path, env: JobEnv, container_path: str) -> Iterator[str]:
    """The config where the job environment reads it (a copy on a host, mounted at container_path
    in an image), for a check or a fingerprint; removed afterwards."""
    if env.host is None:
        path = str(config.resolve())
    else:
        # A random name made here, as warm-cache's work dir is: the host needs only a POSIX shell.
        name = f"$HOME/.cache/dflashctl/preflight-{secrets.token_hex(8)}"
        script = f'umask 077 && mkdir -p "{name}" && cd "{name}" && pwd'
        rdir = remote.run(env.host, ["sh", "-c", script]).stdout.decode().strip()
        path = f"{rdir}/{config.name}"
        remote.copy_to(env.host, str(config), path)
    try:
        if env.image is not None:
            env.mounts = [*env.mounts, (path, container_path, True)]
            yield container_path
        else:
            yield path
    finally:
        if env.image is not None:
            env.mounts = [m for m in env.mounts if m[1] != container_path]
        if env.host is not None:
            remote.run(env.host, ["rm", "-rf", str(Path(path).parent)], check=False)


def job_fingerprint(
    env: JobEnv,
    *,
    config: str | None,
    sets: list[str] | None = None,
    device: str | None = None,
    shown_as: str | Path | None = None,
    read_only: bool = False,
) -> dict:
    """{key, fingerprint} from `python -m dflash.fingerprint` in the target environment; read_only:
    it writes nothing there (`run --dry-run`: a tiny target is built in a temporary directory).

    Without a config only the environment and source parts are reported (and compared). A config
    the job refuses is BadInput with the job's own lines, naming the config as shown_as (the user's
    path; config is where the environment reads it)."""
    args = ["dflash.fingerprint", "--json"]
    if config:
        args.append(config)
    elif device in ("cpu", "cuda"):
        args += ["--device", device]
    for s in sets or []:
        args += ["--set", s]
    if read_only and config:
        args.append("--read-only")
    proc = remote.run(env.host, env.argv(args), check=False, timeout=600)
    problems = job_refusal(proc.returncode, proc.stderr or b"") if config else []
    if problems:
        raise refused("dflash.fingerprint", env, shown_as or config or "", problems)
    if proc.returncode != 0:
        raise remote.failure(env.host, env.argv(args), proc)
    result = parse_json_tail(
        proc.stdout, f"`{shlex.join(env.argv(args))}`", "is dflash installed in that environment?"
    )
    if not isinstance(result.get("fingerprint"), dict):
        raise RunnerError(
            "dflash.fingerprint returned no fingerprint object; dflash there is too old or broken"
        )
    return result
