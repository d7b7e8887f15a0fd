"""The launcher's plan of hosts: the rendezvous endpoint, each host's role, and what `--plan` prints."""

from __future__ import annotations

import argparse
import ipaddress
import re
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.config import set_args

if TYPE_CHECKING:
    from dflash.config import JobConfig

LOCAL_ENDPOINT = "127.0.0.1:0"
_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def endpoint_problem(value: str) -> str | None:
    """Why `value` is not a rendezvous HOST:PORT (a hostname, an IPv4 address or [IPv6], port
    1-65535), in words; None when it is one. It reaches torchrun's command line, so a leading '-'
    (read as an option) is refused first."""
    if value.startswith("-"):
        return "it starts with '-', which a command line reads as an option"
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
        if not sep:
            return "an IPv6 address goes as [ADDRESS]:PORT"
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"{host!r} between the brackets is not an IPv6 address"
    else:
        host, sep, port = value.rpartition(":")
        if not sep:
            return "no :PORT"
        if not host:
            return "no HOST before the :"
        if re.fullmatch(r"[0-9.]+", host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                return f"{host!r} is not an IPv4 address"
        elif ":" in host:
            return f"{host!r} has a ':': write an IPv6 address in brackets, [ADDRESS]:PORT"
        elif len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in host.split(".")):
            return f"{host!r} is not a hostname (letters, digits, '-', '_' in dot-separated labels)"
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        return f"port {port!r} is not a number in 1..65535"
    return None


def host_problems(
    cfg: JobConfig, nnodes_arg: int | None, node_rank: int, endpoint_arg: str | None
) -> tuple[int, str, list[tuple[str, str]]]:
    """(nnodes, rendezvous endpoint, problems as (config key, message)) of a launch's host arguments:
    every rule the group needs, checked before anything starts (dflash.check reports them all)."""
    problems: list[tuple[str, str]] = []
    for given, value in (
        ("--rdzv-endpoint", endpoint_arg),
        ("pipeline.rdzv_endpoint", cfg.pipeline.rdzv_endpoint),
    ):
        why = endpoint_problem(value) if value else None
        if why is not None:
            problems.append(
                (
                    "pipeline.rdzv_endpoint",
                    f"{given} {value!r} is not HOST:PORT: {why}; pass an address of host 0 that every "
                    "host can reach, e.g. 10.0.0.1:29400, gpu0.cluster:29400 or [fd00::1]:29400",
                )
            )
    if nnodes_arg is not None and nnodes_arg < 1:
        problems.append(("pipeline.nnodes", f"--nnodes must be >= 1, got {nnodes_arg}"))
    nnodes = nnodes_arg if nnodes_arg is not None and nnodes_arg >= 1 else cfg.pipeline.nnodes
    if not 0 <= node_rank < nnodes:
        problems.append(
            ("pipeline.nnodes", f"--node-rank {node_rank} must be in 0..{nnodes - 1} (--nnodes {nnodes})")
        )
    # One host: port 0, so the rendezvous store binds a free port itself (as `torchrun --standalone`
    # does). A port picked here and bound seconds later could be taken meanwhile, and c10d would
    # then join whatever store listens there, possibly another job's group.
    endpoint = endpoint_arg or (cfg.pipeline.rdzv_endpoint if nnodes > 1 else LOCAL_ENDPOINT)
    if nnodes > 1 and not endpoint:
        problems.append(
            (
                "pipeline.rdzv_endpoint",
                f"{nnodes} hosts need a rendezvous: pass --rdzv-endpoint HOST0:PORT (or set "
                "pipeline.rdzv_endpoint), an address of host 0 that every host can reach, e.g. "
                "10.0.0.1:29400 (127.0.0.1 only when every launch runs on this machine)",
            )
        )
    if nnodes > 1 and cfg.train.keep_last < 2:
        problems.append(
            (
                "train.keep_last",
                "train.keep_last must be >= 2 with several hosts: a restarted group resumes from the "
                "newest step every host still holds, which can be one behind on some hosts",
            )
        )
    return nnodes, endpoint, problems


def plan(cfg: JobConfig, args: argparse.Namespace, nnodes: int, endpoint: str) -> dict[str, Any]:
    """Every host's command as data (`--plan --json` prints it; plain `--plan` renders it as shell
    lines): module_args follow `python -m`, so a runner can put each host's own interpreter first."""
    # Run directories are per host: checkpoints are written by every host's local rank 0. Stamped
    # like open_run_dir's default, so running a plan again starts a new run instead of resuming.
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = args.run_dir or str(Path(cfg.run.runs_root) / f"{cfg.run.name}-{stamp}")
    sets = set_args(args.overrides)
    hosts = [
        {
            "node_rank": i,
            "run_dir": f"{run_dir}-node{i}",
            "module_args": [
                "dflash.launch",
                args.config,
                *sets,
                "--run-dir",
                f"{run_dir}-node{i}",
                "--nnodes",
                str(nnodes),
                "--node-rank",
                str(i),
                "--rdzv-endpoint",
                endpoint,
            ],
        }
        for i in range(nnodes)
    ]
    return {"nnodes": nnodes, "rdzv_endpoint": endpoint, "run_dir": run_dir, "hosts": hosts}


def plan_lines(p: dict[str, Any]) -> list[str]:
    return [shlex.join([sys.executable, "-m", *host["module_args"]]) for host in p["hosts"]]


"""A one-host group's rendezvous: loopback, the port chosen by the store when it binds."""


"""One DNS label (RFC 1123, plus the '_' that cluster host names often carry and resolvers accept)."""
