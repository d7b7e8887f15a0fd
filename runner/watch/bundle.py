"""The sampler as one self-contained Python program, so a GPU host needs nothing but python3:

    ssh HOST python3 - --run-dir RUN_DIR --interval 1     <  bundle_source()

The program installs the sampler's modules (and this machine's pynvml.py, used only where the host
has none) as in-memory modules and runs `runner.watch.sampler.main`: the very code a local sampler
runs. Locally the same: start_sampler(sampler_argv(...)) in watcher.py.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import zlib
from pathlib import Path

BUNDLED = (
    "rundir.layout",
    "rundir.schema",
    "watch.procinfo",
    "watch.nvml",
    "watch.fakenvml",
    "watch.sampler",
)
"""The sampler's modules under runner/, in import order (each stdlib only but for those before it)."""

_BOOT = """\
import base64, sys, types, zlib
def _install(name, packed):
    module = types.ModuleType(name)
    module.__file__ = "<dflashctl bundle: " + name + ">"
    sys.modules[name] = module
    exec(compile(zlib.decompress(base64.b64decode(packed)).decode(), module.__file__, "exec"), module.__dict__)
    return module
for _pkg in ("runner", "runner.rundir", "runner.watch"):
    if _pkg not in sys.modules:
        sys.modules[_pkg] = types.ModuleType(_pkg)
        sys.modules[_pkg].__path__ = []
sys.modules["runner"].rundir = sys.modules["runner.rundir"]
sys.modules["runner"].watch = sys.modules["runner.watch"]
PYNVML = {pynvml!r}
if PYNVML:
    try:
        import pynvml
    except ImportError:
        _install("pynvml", PYNVML)
for _name, _packed in {modules!r}:
    _parent, _, _leaf = ("runner." + _name).rpartition(".")
    setattr(sys.modules[_parent], _leaf, _install("runner." + _name, _packed))
raise SystemExit(sys.modules["runner.watch.sampler"].main(sys.argv[1:]))
"""


def _pack(text: str) -> str:
    return base64.b64encode(zlib.compress(text.encode(), 9)).decode()


@functools.lru_cache(maxsize=2)
def bundle_source(include_pynvml: bool = True) -> str:
    """One self-contained Python program (for `python3 -`) that runs this sampler with its modules.
    With include_pynvml, this machine's pynvml.py travels too and is used where the host has none
    (the job's environment often lacks nvidia-ml-py)."""
    runner_dir = Path(__file__).resolve().parents[1]
    modules = [(name, _pack((runner_dir / f"{name.replace('.', '/')}.py").read_text())) for name in BUNDLED]
    pynvml = ""
    if include_pynvml:
        spec = importlib.util.find_spec("pynvml")
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            pynvml = _pack(Path(spec.origin).read_text())
    return _BOOT.format(pynvml=pynvml, modules=modules)


def sampler_argv(
    run_dir: str | Path,
    *,
    interval_s: float = 1.0,
    once: bool = False,
    python: str = "python3",
    fake_nvml: str | Path | None = None,
    keep: bool = False,
) -> list[str]:
    """The command that runs the sampler with bundle_source() on its stdin; over ssh, pass it as one
    shell word list (shlex.join) after the host."""
    argv = [python, "-", "--run-dir", str(run_dir), "--interval", str(interval_s)]
    if once:
        argv.append("--once")
    if fake_nvml is not None:
        argv += ["--fake-nvml", str(fake_nvml)]
    if keep:
        argv.append("--keep")
    return argv
