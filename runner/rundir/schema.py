"""The shape of every record the runner reads (docs/run-directory.md): run.json, metrics.jsonl and
events.jsonl records, worker heartbeats, watch samples, and the run registry's entries.

Every reader on the runner side goes through here, so the verbs and detectors can trust the types of
the fields they read: `loads` turns bytes into JSON or one `Damaged` error (not UTF-8, torn, nested
deeper than MAX_DEPTH, a number no writer of these files produces: beyond 64 bits, infinite, NaN),
and `problem(schema, value)` says what is wrong with a record, in words, or None. A reader skips a
record of the wrong shape and counts it (`Tally`); a whole file that is damaged is one line naming
the file, what is wrong and what to do.

Stdlib only: the watch sampler, bundled onto GPU hosts that have nothing but python3, checks its
heartbeats with it too (runner/watch/bundle.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_DEPTH = 64
"""Nesting the job's records never come near (a run.json config is 3 levels deep)."""
MAX_INT = 2**63 - 1
MAX_TEXT_BYTES = 64 << 20
"""A single JSON file larger than this is not one the job wrote (run.json, a heartbeat, an entry)."""


class Damaged(ValueError):
    """Bytes that are no JSON document a writer of the run directory produces."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 19:
        raise Damaged(f"an integer of {len(text.lstrip('-'))} digits")
    value = int(text)
    if abs(value) > MAX_INT:
        raise Damaged(f"an integer beyond 64 bits ({text[:24]})")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Damaged(f"a number out of range ({text[:24]})")
    return value


def _constant(name: str) -> float:
    raise Damaged(f"{name}, which JSON does not have")


def loads(data: bytes | str) -> Any:
    """The JSON value of `data`, or Damaged saying in words why there is none."""
    if isinstance(data, bytes):
        if len(data) > MAX_TEXT_BYTES:
            raise Damaged(f"{len(data)} bytes, more than any record")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Damaged(f"not UTF-8 text (byte {e.start})") from None
    if "\x00" in data:
        raise Damaged("NUL bytes in the text")
    try:
        value = json.loads(data, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise Damaged(f"nested deeper than {MAX_DEPTH} levels") from None
    except Damaged:
        raise
    except ValueError as e:
        what = "empty" if not data.strip() else f"not JSON ({str(e).split(':')[0]})"
        raise Damaged(what) from None
    depth = _depth(value)
    if depth > MAX_DEPTH:
        raise Damaged(f"nested deeper than {MAX_DEPTH} levels")
    return value


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        deepest = max(deepest, d)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((c, d + 1) for c in children)
    return deepest


@dataclass(frozen=True, slots=True)
class Kind:
    """A field's type, with its name in the words a problem line uses."""

    name: str
    test: Callable[[Any], bool]

    def __call__(self, value: Any) -> bool:
        return self.test(value)


def _is_num(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and abs(v) <= MAX_INT


INT = Kind("an integer", lambda v: type(v) is int and abs(v) <= MAX_INT)
NUM = Kind("a number", _is_num)
STR = Kind("a string", lambda v: type(v) is str)
BOOL = Kind("true or false", lambda v: type(v) is bool)
DICT = Kind("an object", lambda v: type(v) is dict)
LIST = Kind("a list", lambda v: type(v) is list)


def opt(k: Kind) -> Kind:
    return Kind(f"{k.name} or null", lambda v: v is None or k(v))


def list_of(k: Kind) -> Kind:
    return Kind(f"a list, each {k.name}", lambda v: type(v) is list and all(k(x) for x in v))


def dict_of(k: Kind) -> Kind:
    return Kind(f"an object, each value {k.name}",
                lambda v: type(v) is dict and all(type(x) is str and k(y) for x, y in v.items()))  # fmt: skip


def record(fields: Mapping[str, Kind], name: str = "an object") -> Kind:
    """An object whose listed fields, where present, have these kinds."""
    return Kind(name, lambda v: type(v) is dict and all(f not in v or k(v[f]) for f, k in fields.items()))


@dataclass(frozen=True, slots=True)
class Schema:
    what: str
    """What one record is called in a problem line ("a heartbeat")."""
    fields: Mapping[str, Kind]
    required: tuple[str, ...] = ()


def describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def problem(schema: Schema, value: Any) -> str | None:
    """None for a record of this shape; else what is wrong with it, in words."""
    if type(value) is not dict:
        return f"{describe(value)} where {schema.what} belongs"
    for name in schema.required:
        if name not in value:
            return f"no `{name}`"
    for name, kind in schema.fields.items():
        if name in value and not kind(value[name]):
            return f"`{name}` is {describe(value[name])}, not {kind.name}"
    return None


# -- the records ------------------------------------------------------------------------------------

ANY_RECORD = Schema("a record", {})
"""Any JSON object: for a file whose records have no schema of their own."""

RUN_JSON = Schema(
    "the run's manifest",
    {
        "format": INT,
        "run_id": STR,
        "runner": opt(DICT),
        "config": DICT,
        "started_at": opt(NUM),
        "project_commit": opt(STR),
        "hosts": list_of(STR),
        "command_lines": LIST,
        "lock_sha256": opt(STR),
        "cache_artifact": opt(STR),
        "image_digest": opt(STR),
    },
)

METRICS = Schema(
    "a status record",
    {
        "t": NUM,
        "elapsed_s": opt(NUM),
        "step": INT,
        "loss": opt(NUM),
        "acc": opt(NUM),
        "acc_per_pos": list_of(opt(NUM)),
        "streak": opt(NUM),
        "lr": opt(NUM),
        "noise": opt(NUM),
        "grad_norm": opt(NUM),
        "tgt_bps": opt(NUM),
        "dft_bps": opt(NUM),
        "tok_s": opt(NUM),
        "q_pre": list_of(opt(NUM)),
        "q_hs": list_of(opt(NUM)),
        "epoch": opt(NUM),
        "eta_s": opt(NUM),
        "compile": dict_of(opt(NUM)),
        "gpu_mem_gb": dict_of(opt(NUM)),
        "world_size": INT,
        "generation": INT,
        "queue": dict_of(opt(NUM)),
    },
    required=("t",),
)

PHASE = record({"phase": STR, "start": NUM, "seconds": NUM}, "a phase")

EVENTS = Schema(
    "an event",
    {
        # Every event: when, what, who.
        "t": NUM,
        "event": STR,
        "host": opt(STR),
        "pid": opt(INT),
        "source": opt(STR),
        # One meaning each, whichever event carries them (docs/run-directory.md).
        "step": opt(INT),
        "worker": opt(STR),
        "role": opt(STR),
        "generation": opt(INT),
        "reason": opt(STR),
        "error": opt(STR),
        "exit_code": opt(INT),
        "mode": opt(STR),
        "resumed_from": opt(INT),
        "targets": dict_of(opt(INT)),
        "drafter_group_pid": opt(INT),
        "node_rank": opt(INT),
        # finding / action / recovered (watch) and injected (demo)
        "severity": opt(STR),
        "kind": opt(STR),
        "subject": opt(STR),
        "message": opt(STR),
        "advice": opt(STR),
        "numbers": opt(DICT),
        "action": opt(STR),
        "ok": opt(BOOL),
        "after_s": opt(NUM),
        # generation_start
        "origin": opt(STR),
        "origin_at": opt(NUM),
        "ready_at": opt(NUM),
        "total_s": opt(NUM),
        "phases": list_of(PHASE),
        "graphs": dict_of(opt(NUM)),
        "died_at_step": opt(INT),
        "rolled_back_steps": opt(INT),
        # tau
        "tau": opt(NUM),
        "histogram": dict_of(opt(NUM)),
        "acceptance_per_position": list_of(opt(NUM)),
        "acc": opt(NUM),
        "tokens_per_s": opt(NUM),
        "seconds": opt(NUM),
    },
    required=("event",),
)

HEARTBEAT = Schema(
    "a heartbeat",
    {
        "pid": INT,
        "host": opt(STR),
        "role": STR,
        "index": opt(INT),
        "rank": opt(INT),
        "device": opt(STR),
        "gpu_uuid": opt(STR),
        "state": STR,
        "state_since": opt(NUM),
        "step": opt(INT),
        "last_progress_at": opt(NUM),
        "updated_at": NUM,
        "started_at": opt(NUM),
        "q_pre": opt(NUM),
        "state_s": opt(dict_of(NUM)),
        "alloc_retries": opt(INT),
    },
)

# The sampler writes "n/a" where NVML cannot tell: a reading is a number or a string.
READING = Kind("a number, a string or null", lambda v: v is None or type(v) is str or _is_num(v))
SAMPLE_GPU = record(
    {"index": INT, "util_gpu": READING, "mem_used_mb": READING, "mem_total_mb": READING}, "a GPU reading"
)
SAMPLE_WORKER = record({"state": READING, "step": READING, "gpu_index": READING}, "a worker")

SAMPLE = Schema(
    "a watch sample",
    {"t": NUM, "host": opt(STR), "gpus": list_of(SAMPLE_GPU), "workers": dict_of(SAMPLE_WORKER)},
    required=("t",),
)

HOST_ENTRY = record(
    {
        "node_rank": INT,
        "host": opt(STR),
        "run_dir": STR,
        "tmux_session": opt(STR),
        "tmux_window": opt(STR),
        "container": opt(STR),
    },
    "a host",
)

REGISTRY_ENTRY = Schema(
    "a run registry entry",
    {
        "run_id": STR,
        "name": STR,
        "backend": STR,
        "created_at": NUM,
        "config": STR,
        "hosts": list_of(HOST_ENTRY),
        "argv": dict_of(list_of(STR)),
        "plan": DICT,
    },
    required=("run_id", "name", "backend", "created_at", "config", "hosts"),
)

BASELINE = Schema(
    "a throughput baseline",
    {
        "fingerprint_key": STR,
        "config_hash": STR,
        "tok_s": NUM,
        "runs": list_of(record({"run_id": opt(STR), "tok_s": opt(NUM), "records": opt(INT), "at": opt(NUM)})),
        "updated_at": NUM,
    },
    required=("fingerprint_key", "config_hash", "tok_s"),
)


def parse_record(schema: Schema, data: bytes | str) -> dict[str, Any]:
    """One whole-file record (run.json, a heartbeat, a registry entry), or Damaged in words."""
    value = loads(data)
    why = problem(schema, value)
    if why is not None:
        raise Damaged(why)
    return value


@dataclass(slots=True)
class Tally:
    """Records of one file a reader skipped, and why (the first reason of each kind kept)."""

    skipped: int = 0
    reasons: list[str] = field(default_factory=list)

    def skip(self, why: str) -> None:
        self.skipped += 1
        if len(self.reasons) < 3 and why not in self.reasons:
            self.reasons.append(why)

    def line(self, name: str) -> str:
        return f"{name}: {self.skipped} damaged record{'s' * (self.skipped != 1)} skipped ({'; '.join(self.reasons)})"


def parse_lines(schema: Schema, text: str | bytes, tally: Tally | None = None) -> list[dict[str, Any]]:
    """The records of JSONL text of the right shape, in order. A line that is not JSON or of the
    wrong shape is skipped and counted in `tally`; so is a torn line (the cut-off first line of a
    tail is the caller's to drop)."""
    if isinstance(text, bytes):
        lines: list[Any] = text.split(b"\n")
    else:
        lines = text.split("\n")
    out = []
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = loads(line)
        except Damaged as e:
            if tally is not None:
                tally.skip(str(e))
            continue
        why = problem(schema, rec)
        if why is not None:
            if tally is not None:
                tally.skip(why)
            continue
        out.append(rec)
    return out


# -- whole files ------------------------------------------------------------------------------------

FIX = {
    "the run's manifest": "the job writes run.json whole at each start; if no job runs there, move the "
    "run directory away",
    "a heartbeat": "a live worker rewrites its heartbeat every status interval; one that stays damaged "
    "is a worker that is gone",
    "a run registry entry": "remove that file if the run is not needed (`dflashctl ps --all` lists the others)",
    "a throughput baseline": "remove that file: the next healthy run under `dflashctl watch` sets it again",
}


def damaged_line(name: str, schema: Schema, why: str) -> str:
    """One line for a whole file that is damaged: the file, what is wrong, what to do."""
    return f"{name} is damaged ({why}); {FIX.get(schema.what, 'it is skipped')}"


def read_record_file(path: Any, schema: Schema) -> tuple[dict[str, Any] | None, str | None]:
    """(the record, None), (None, None) when the file is absent, or (None, the damaged line)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{path} cannot be read ({e.strerror or e}); check its permissions"
    try:
        return parse_record(schema, data), None
    except Damaged as e:
        return None, damaged_line(str(path), schema, str(e))
