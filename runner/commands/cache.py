"""`dflashctl cache list|show|verify|restore|prune|push|pull`: compile-cache artifacts."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from runner.cache import transfer
from runner.cache.manifest import MANIFEST_NAME
from runner.cache.restore import format_differences, restore
from runner.cache.signing import check_signature, load_keyring
from runner.cache.store import STORE_ENV, Artifact, Store, parse_age
from runner.cache.verify import verify_artifact
from runner.console import cli_errors, console, err_console
from runner.errors import RunnerError
from runner.exec.jobenv import JobEnv, job_fingerprint, job_image
from runner.launch.plan import managed_cache_dir

app = typer.Typer(
    help="Compile-cache artifacts: list, show, verify, restore, prune, push, pull.", no_args_is_help=True
)

StoreOpt = Annotated[
    Path | None,
    typer.Option(
        "--store",
        envvar=STORE_ENV,
        show_envvar=True,
        help="Artifact store directory (default $XDG_CACHE_HOME/dflashctl/artifacts, i.e. "
        "~/.cache/dflashctl/artifacts when XDG_CACHE_HOME is unset).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def env_summary(fp: dict[str, Any]) -> dict[str, Any]:
    """The columns `cache list` shows, from whatever the fingerprint holds (it is checked only as
    canonical JSON, so any field may have any type)."""
    env = fp.get("env", {}) if isinstance(fp.get("env"), dict) else {}
    gpus = env.get("gpus")
    gpus = gpus if isinstance(gpus, list) else []
    names = [f"{g.get('name')} ({g.get('capability')})" for g in gpus if isinstance(g, dict)]
    gpu = ", ".join(names) or str(env.get("device_type", "-"))
    return {"torch": env.get("torch"), "triton": env.get("triton"), "cuda": env.get("cuda"), "gpu": gpu}


def _row(art: Artifact, ring: Any) -> dict[str, Any]:
    status, _ = check_signature(art.manifest, ring)
    return {
        "key": art.key,
        "size": art.manifest.archive.size,
        "files_size": art.manifest.files_size,
        "files": len(art.manifest.files),
        "created_at": art.manifest.created_at,
        "config_name": art.manifest.config_name,
        **env_summary(art.manifest.fingerprint),
        "signature": status,
        "origin": (art.origin or {}).get("origin", "local"),
        "path": str(art.path),
    }


@app.command("list")
def list_cmd(store: StoreOpt = None, as_json: JsonOpt = False) -> None:
    """List artifacts, newest first."""
    with cli_errors():
        st = Store(store)
        arts, broken = st.artifacts()
        ring = load_keyring()
        rows = [_row(a, ring) for a in arts]
        if as_json:
            typer.echo(
                json.dumps(
                    {
                        "store": str(st.root),
                        "artifacts": rows,
                        "broken": [{"key": k, "problem": p} for k, p in broken],
                    },
                    indent=1,
                )
            )
            return
        if not rows:
            console.print(f"no artifacts in {st.root}; create one with `dflashctl warm-cache CONFIG.toml`")
        else:
            table = Table(title=f"compile-cache artifacts in {st.root}")
            for col in ("key", "size", "created", "config", "torch", "triton", "GPU", "signature", "origin"):
                table.add_column(col, overflow="fold", no_wrap=col == "key")
            for r in rows:
                cells = (
                    r["key"][:16],
                    _human(r["size"]),
                    r["created_at"],
                    r["config_name"],
                    r["torch"],
                    r["triton"],
                    r["gpu"],
                    r["signature"],
                    r["origin"],
                )
                table.add_row(*(escape(str(c)) for c in cells))  # manifest text is data, not markup
            console.print(table)
        _report_broken(broken)


def _report_broken(broken: list[tuple[str, str]]) -> None:
    for key, problem in broken:
        err_console.print(f"[yellow]broken artifact {key[:16]}:[/] {escape(problem)}", highlight=False)


@app.command("show")
def show_cmd(
    key: Annotated[str, typer.Argument(help="Artifact key or unique prefix.")],
    store: StoreOpt = None,
    files: Annotated[bool, typer.Option(help="Include the file list.")] = False,
) -> None:
    """Print an artifact's manifest (fingerprint, warm statistics, signature) as JSON."""
    with cli_errors():
        art = Store(store).get(key)
        data = art.manifest.to_dict()
        if not files:
            data["files"] = (
                f"{len(art.manifest.files)} files, {art.manifest.files_size} bytes (--files lists them)"
            )
        status, detail = check_signature(art.manifest, load_keyring())
        data["signature_status"] = f"{status}: {detail}"
        data["origin"] = art.origin or {"origin": "local"}
        data["path"] = str(art.path)
        typer.echo(json.dumps(data, indent=1, sort_keys=True))


@app.command("verify")
def verify_cmd(
    key: Annotated[str, typer.Argument(help="Artifact key or unique prefix.")], store: StoreOpt = None
) -> None:
    """Re-check the archive hash and every file's hash (by extracting into a scratch dir)."""
    with cli_errors():
        with Store(store).reading(key) as art:
            n, size, sig = verify_artifact(art, load_keyring())
        console.print(
            f"[green]ok[/] {art.key}: archive and {n} files ({_human(size)}) match the manifest; "
            f"signature {sig}",
            highlight=False,
        )


@contextlib.contextmanager
def _opened(st: Store, ref: str) -> Iterator[Artifact]:
    """A store artifact (under its shared lock) or an artifact directory elsewhere (foreign: it
    needs a valid signature, like a pulled one)."""
    path = Path(ref).expanduser()
    if path.is_dir() and os.path.lexists(path / MANIFEST_NAME):
        if path.resolve().parent == st.root.resolve():
            with st.reading(path.name) as art:
                yield art
            return
        yield Artifact.load(path, foreign=True)
        return
    with st.reading(ref) as art:
        yield art


@app.command("restore")
def restore_cmd(
    ref: Annotated[
        str, typer.Argument(help="Artifact key (or prefix) in the store, or an artifact directory.")
    ],
    dest: Annotated[
        Path, typer.Option("--dest", help="Live cache dir to create or replace (the job's cache dir).")
    ],
    force: Annotated[
        bool, typer.Option(help="Restore even if the fingerprint differs from the destination.")
    ] = False,
    trust: Annotated[
        bool, typer.Option(help="Accept an unsigned or wrongly signed artifact from elsewhere.")
    ] = False,
    python: Annotated[
        str | None,
        typer.Option(
            help="Interpreter of the environment that will use the cache (default: dflashctl's own)."
        ),
    ] = None,
    image: Annotated[
        str | None, typer.Option(help="...or a container image holding that environment.")
    ] = None,
    variant: Annotated[
        str | None,
        typer.Option(help="...or the newest `dflashctl build` image of this variant (dflash:<variant>)."),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="Job config: also compare the compile-relevant job part.")
    ] = None,
    sets: Annotated[
        list[str] | None, typer.Option("--set", help="Config override key=value (with --config).")
    ] = None,
    keep_previous: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Previous caches to keep beside DEST as DEST.prev-<time> (default: [cache] "
            "keep_previous in dflashctl's config file, else 2).",
        ),
    ] = None,
    store: StoreOpt = None,
) -> None:
    """Verify an artifact, check it against the destination environment, and swap it in safely."""
    with cli_errors():
        image = job_image(image, variant)
        st = Store(store)
        env = JobEnv(python=python or (sys.executable if image is None else "python3"), image=image)
        cfg_arg = None
        if config is not None:
            cfg_arg = str(config.resolve())
            if image:
                env.mounts.append((cfg_arg, "/dflash-config.toml", True))
                cfg_arg = "/dflash-config.toml"
        with _opened(st, ref) as art:
            device = str(art.manifest.fingerprint.get("env", {}).get("device_type", "auto"))
            # A CUDA cache is compared against the GPUs the container will see: give it them.
            env.gpus = image is not None and device == "cuda"
            try:
                probe = job_fingerprint(env, config=cfg_arg, sets=sets, device=None if cfg_arg else device)
                dest_fp: dict[str, Any] | None = probe["fingerprint"]
            except RunnerError as e:
                if not force:
                    raise RunnerError(
                        f"cannot read the destination environment's fingerprint: {e}\nPass --python "
                        "(or --image) for the environment that will use the cache, or --force to skip "
                        "the check"
                    ) from None
                err_console.print(
                    f"[yellow]warning:[/] fingerprint check skipped (--force): {e}", highlight=False
                )
                dest_fp = None
            result = restore(
                art,
                dest,
                dest_fingerprint=dest_fp,
                ring=load_keyring(),
                force=force,
                trust=trust,
                keep_previous=keep_previous,
            )
        if result.differences:
            err_console.print(
                "[yellow]warning:[/] restored despite fingerprint differences (--force):\n"
                + format_differences(result.differences),
                highlight=False,
            )
        console.print(
            f"[green]restored[/] {result.key[:16]} into {result.dest}: {result.files} files, "
            f"{_human(result.bytes)}; signature {result.signature}",
            highlight=False,
        )
        if result.moved_aside is not None:
            console.print(f"previous cache kept at {result.moved_aside}", highlight=False)
        for gone in result.swept:
            console.print(f"deleted {gone} (an older previous cache, or a killed restore's)", highlight=False)
        console.print(
            f"use it with: export DFLASH_CACHE_DIR={result.dest} (or TORCHINDUCTOR_CACHE_DIR="
            f"{result.dest}/inductor TRITON_CACHE_DIR={result.dest}/triton)",
            highlight=False,
        )


def managed_restore_root() -> Path:
    """Where `dflashctl run` restores caches on this machine (one directory per key)."""
    return Path(managed_cache_dir(str(Path.home()), "-", "")).parent


@app.command("prune")
def prune_cmd(
    keep: Annotated[int | None, typer.Option(help="Keep the N newest artifacts.")] = None,
    older_than: Annotated[
        str | None, typer.Option(help="Remove artifacts older than AGE (30m, 12h, 7d, 2w).")
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="Only print what would be removed.")] = False,
    store: StoreOpt = None,
) -> None:
    """Remove old artifacts (with both options the newest N stay and older ones past AGE go), and
    always the temp dirs that killed warm, pull, verify or restore processes left behind."""
    with cli_errors():
        age = parse_age(older_than) if older_than is not None else None
        pruned = Store(store).prune(
            keep=keep, older_than=age, dry_run=dry_run, restore_dirs=(managed_restore_root(),)
        )
        verb = "would remove" if dry_run else "removed"
        for art in pruned.removed:
            console.print(
                f"{verb} {art.key[:16]} ({art.manifest.config_name}, {art.manifest.created_at})",
                highlight=False,
            )
        for path in pruned.leftovers:
            console.print(f"{verb} leftover {path}", highlight=False)
        hint = (
            "" if keep is not None or age is not None else " (--keep N or --older-than AGE removes artifacts)"
        )
        console.print(
            f"{verb} {len(pruned.removed)} artifact(s) and {len(pruned.leftovers)} leftover temp dir(s){hint}",
            highlight=False,
        )
        _report_broken(pruned.broken)


RemoteOpt = Annotated[
    str, typer.Option("--remote", help="Remote store USER@HOST:DIR (ssh; DFLASH_SSH_OPTS applies).")
]


@app.command("push")
def push_cmd(
    key: Annotated[str, typer.Argument(help="Artifact key or unique prefix.")],
    remote: RemoteOpt,
    store: StoreOpt = None,
) -> None:
    """Copy an artifact to a remote store over ssh."""
    with cli_errors():
        where = transfer.push(Store(store), key, remote)
        console.print(f"[green]pushed[/] to {where}", highlight=False)


@app.command("pull")
def pull_cmd(
    key: Annotated[str, typer.Argument(help="Artifact key or unique prefix (in the remote store).")],
    remote: RemoteOpt,
    force: Annotated[
        bool, typer.Option(help="Replace an artifact of the same key that is already in the local store.")
    ] = False,
    store: StoreOpt = None,
) -> None:
    """Copy an artifact from a remote store; it is restored only if signed with your key (or --trust)."""
    with cli_errors():
        art = transfer.pull(Store(store), key, remote, force=force)
        status, detail = check_signature(art.manifest, load_keyring())
        console.print(
            f"[green]pulled[/] {art.key} into {art.path}; signature {status} ({detail})", highlight=False
        )
        if status != "valid":
            err_console.print(
                "[yellow]note:[/] restoring it will need --trust (it is not signed with a key you trust)",
                highlight=False,
            )


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="cache")


__all__ = ["register"]
