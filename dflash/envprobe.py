"""Environment fingerprint: what Python, torch, CUDA, driver and GPUs this interpreter sees.

Standard library only, and torch/triton/pynvml are imported lazily through importlib, so the same
file runs three ways:

    python -m dflash.envprobe          # inside an environment that has dflash installed
    python - < dflash/envprobe.py      # any python (a container, a venv, a host over ssh)
    from dflash.envprobe import probe  # in-process (the cache key, run.json)

Both command forms print `probe()` as one JSON object on stdout; anything the imported libraries
print while being probed is sent to stderr so stdout stays parseable. `probe()` never raises: a part
that cannot be read is null (or an empty list) and the reason goes into `errors`.

Fields (stable: the compile-cache key and `dflashctl doctor` read them by these names):

    schema            int, 1
    python            {version "3.11.9", implementation "cpython", executable, prefix, base_prefix}
    platform          {system "Linux", machine "x86_64", release, libc "glibc 2.39" | null}
    markers           PEP 508 environment markers {sys_platform, platform_machine, python_full_version,
                      ...}: what a lock's `; marker` conditions are evaluated against
    torch             null when torch is not importable, else
                      {version "2.11.0+cu130", git_version, cuda "13.0" | null, cudnn 91002 | null,
                       nccl "2.27.7" | null, hip | null, debug bool, cuda_available bool,
                       arch_list ["sm_90", ...]}
    triton            null, or {version "3.6.0"}
    driver            {version "580.95.05" | null, cuda "13.0" | null (the newest CUDA the driver
                       supports), source "nvml" | "proc" | null}
    gpus              [{index, name, compute_capability "9.0", memory_total_mib, source "torch"|"nvml"}]
                      (torch's view when CUDA is usable, so CUDA_VISIBLE_DEVICES applies)
    packages          {normalized distribution name: version} of every installed distribution; when
                      a name is installed twice (a venv over system site-packages) the one found
                      first on sys.path, the one `import` uses, wins
    paths             {inductor_cache, home_cache, tmp}: directories where caches live
    disk_free_bytes   {same keys: free bytes on the filesystem holding it (nearest existing parent)}
    tools             {tmux: path | null, docker: path | null, nvidia_smi: path | null}
    errors            [str]: what could not be probed and why

The compile-relevant subset (python.version, torch.version/git_version/cuda/cudnn/nccl,
triton.version, gpus[].name/compute_capability) is what the cache key hashes; the rest is for doctor.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
from typing import Any

from dflash.exiting import without_final_gc

SCHEMA = 1


def normalize_name(name: str) -> str:
    """PEP 503 name normalization: `Typing_Extensions` and `typing.extensions` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _python() -> dict[str, Any]:
    return {
        "version": platform.python_version(),
        "implementation": sys.implementation.name,
        "executable": sys.executable,
        "prefix": sys.prefix,
        "base_prefix": getattr(sys, "base_prefix", sys.prefix),
    }


def _platform() -> dict[str, Any]:
    lib, ver = platform.libc_ver()
    return {
        "system": platform.system(),
        "machine": platform.machine(),
        "release": platform.release(),
        "libc": f"{lib} {ver}" if lib else None,
    }


def _markers() -> dict[str, str]:
    # The same values pip and uv use to decide which `; marker` lines of a lock apply here.
    impl = sys.implementation
    iv = impl.version
    impl_version = f"{iv.major}.{iv.minor}.{iv.micro}"
    if iv.releaselevel != "final":
        impl_version += iv.releaselevel[0] + str(iv.serial)
    return {
        "implementation_name": impl.name,
        "implementation_version": impl_version,
        "os_name": os.name,
        "platform_machine": platform.machine(),
        "platform_python_implementation": platform.python_implementation(),
        "platform_release": platform.release(),
        "platform_system": platform.system(),
        "platform_version": platform.version(),
        "python_full_version": platform.python_version(),
        "python_version": ".".join(platform.python_version_tuple()[:2]),
        "sys_platform": sys.platform,
    }


def _packages(errors: list[str]) -> dict[str, str]:
    try:
        from importlib import metadata
    except ImportError as e:  # python < 3.8
        errors.append(f"packages: importlib.metadata unavailable ({e})")
        return {}
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        try:
            name = dist.metadata["Name"]
        except Exception as e:  # a broken .dist-info must not hide the others
            errors.append(f"packages: unreadable distribution metadata ({e})")
            continue
        if not name:
            continue
        # distributions() walks sys.path in order, so the first hit is the one imports resolve to.
        found.setdefault(normalize_name(name), dist.version)
    return dict(sorted(found.items()))


def _torch(errors: list[str]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    try:
        torch = importlib.import_module("torch")
    except Exception as e:
        if not isinstance(e, ModuleNotFoundError):
            errors.append(f"torch: import failed ({type(e).__name__}: {e})")
        return None, []
    version = getattr(torch, "version", None)
    info: dict[str, Any] = {
        "version": str(getattr(torch, "__version__", "")) or None,
        "git_version": getattr(version, "git_version", None),
        "cuda": getattr(version, "cuda", None),
        "hip": getattr(version, "hip", None),
        "debug": bool(getattr(version, "debug", False)),
        "cudnn": None,
        "nccl": None,
        "cuda_available": False,
        "arch_list": [],
    }
    try:
        info["cudnn"] = torch.backends.cudnn.version()
    except Exception as e:
        errors.append(f"torch.cudnn: {type(e).__name__}: {e}")
    if info["cuda"]:
        try:
            nccl = torch.cuda.nccl.version()
            info["nccl"] = ".".join(str(p) for p in nccl) if isinstance(nccl, tuple) else str(nccl)
        except Exception as e:
            errors.append(f"torch.nccl: {type(e).__name__}: {e}")
    gpus: list[dict[str, Any]] = []
    try:
        info["cuda_available"] = bool(torch.cuda.is_available())
        info["arch_list"] = list(torch.cuda.get_arch_list())
        if info["cuda_available"]:
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append(
                    {
                        "index": i,
                        "name": p.name,
                        "compute_capability": f"{p.major}.{p.minor}",
                        "memory_total_mib": int(p.total_memory) // (1024 * 1024),
                        "source": "torch",
                    }
                )
    except Exception as e:
        errors.append(f"torch.cuda: {type(e).__name__}: {e}")
    return info, gpus


def _triton(errors: list[str]) -> dict[str, Any] | None:
    try:
        triton = importlib.import_module("triton")
    except ModuleNotFoundError:
        return None
    except Exception as e:
        errors.append(f"triton: import failed ({type(e).__name__}: {e})")
        return None
    return {"version": getattr(triton, "__version__", None)}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml(errors: list[str]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    try:
        nv = importlib.import_module("pynvml")
    except Exception:
        return None, []
    try:
        nv.nvmlInit()
    except Exception as e:  # no driver / no GPU: the normal case on a laptop or CI
        errors.append(f"nvml: {type(e).__name__}: {e}")
        return None, []
    driver: dict[str, Any] = {"version": None, "cuda": None, "source": "nvml"}
    gpus: list[dict[str, Any]] = []
    try:
        driver["version"] = _text(nv.nvmlSystemGetDriverVersion())
        with contextlib.suppress(Exception):
            v = int(nv.nvmlSystemGetCudaDriverVersion())
            driver["cuda"] = f"{v // 1000}.{(v % 1000) // 10}"
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            gpu: dict[str, Any] = {
                "index": i,
                "name": _text(nv.nvmlDeviceGetName(h)),
                "compute_capability": None,
                "memory_total_mib": None,
                "source": "nvml",
            }
            with contextlib.suppress(Exception):
                major, minor = nv.nvmlDeviceGetCudaComputeCapability(h)
                gpu["compute_capability"] = f"{major}.{minor}"
            with contextlib.suppress(Exception):
                gpu["memory_total_mib"] = int(nv.nvmlDeviceGetMemoryInfo(h).total) // (1024 * 1024)
            gpus.append(gpu)
    except Exception as e:
        errors.append(f"nvml: {type(e).__name__}: {e}")
    finally:
        with contextlib.suppress(Exception):
            nv.nvmlShutdown()
    return driver, gpus


def _proc_driver() -> dict[str, Any] | None:
    # Containers often lack pynvml but still see the kernel module's version file.
    try:
        with open("/proc/driver/nvidia/version") as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", text)
    return {"version": m.group(1), "cuda": None, "source": "proc"} if m else None


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except Exception:  # a uid with no passwd entry (common in containers)
        return str(os.getuid()) if hasattr(os, "getuid") else "unknown"


def _cache_paths() -> dict[str, str]:
    # Mirrors inductor's default (tempdir/torchinductor_<user>) without importing torch.
    safe_user = re.sub(r"[^A-Za-z0-9_.-]", "_", _user())
    dflash_dir = os.environ.get("DFLASH_CACHE_DIR")  # the job puts inductor's cache under it
    inductor = (
        os.path.join(dflash_dir, "inductor")
        if dflash_dir
        else os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        or os.path.join(tempfile.gettempdir(), f"torchinductor_{safe_user}")
    )
    home_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return {"inductor_cache": inductor, "home_cache": home_cache, "tmp": tempfile.gettempdir()}


def _free_bytes(path: str) -> int | None:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def probe() -> dict[str, Any]:
    """The fingerprint of this interpreter's environment (see the module docstring for fields)."""
    errors: list[str] = []
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "python": _python(),
        "platform": _platform(),
        "markers": _markers(),
    }
    torch_info, torch_gpus = _torch(errors)
    result["torch"] = torch_info
    result["triton"] = _triton(errors)
    nvml_driver, nvml_gpus = _nvml(errors)
    result["driver"] = nvml_driver or _proc_driver() or {"version": None, "cuda": None, "source": None}
    result["gpus"] = torch_gpus or nvml_gpus
    result["packages"] = _packages(errors)
    paths = _cache_paths()
    result["paths"] = paths
    result["disk_free_bytes"] = {k: _free_bytes(v) for k, v in paths.items()}
    result["tools"] = {
        "tmux": shutil.which("tmux"),
        "docker": shutil.which("docker"),
        "nvidia_smi": shutil.which("nvidia-smi"),
    }
    result["errors"] = errors
    return result


def main() -> None:
    # Libraries may print while importing (warnings, banners); keep stdout for the JSON alone.
    with contextlib.redirect_stdout(sys.stderr):
        result = probe()
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    with without_final_gc():
        main()
