#!/usr/bin/env python3
"""The test session's C++ compiler: g++, with its shared objects kept for the rest of the session.

Inductor compiles every CPU kernel module with one command (`g++ X.cpp ... -shared -o X.so`), which
ccache does not cache (it counts it as linking). On CI's 2 cores those compiles are a third of a
cold-compile test's CPU, and most tests compile the same demo graphs cold again, each into its own
fresh inductor cache (they test cold and warm behaviour, so they must). This wrapper keeps what g++
built, keyed by everything that decides it: the real compiler's identity, every argument, and the
contents (not the paths) of the source and of each file an argument names, such as the `-include`d
header. A second identical compile copies the object instead of running g++; inductor itself still
misses, generates, compiles (through here) and loads as it does cold. Anything else (version probes,
`-E`, precompiled headers) runs the real compiler untouched.

conftest.py points CXX at a script named as the real compiler (`g++`) that runs this file (inductor
reads CXX, and tells gcc from clang by that name), DFLASH_TEST_CXX at the real compiler and
DFLASH_TEST_CXX_CACHE at a session temp dir; DFLASH_TEST_CXX_CACHE=off runs the tests without it.
Product code never uses it: the job and the runner compile with whatever CXX the user has.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile


def _key(real: str, args: list[str], out_at: int) -> str:
    h = hashlib.sha256()
    version = subprocess.run([real, "--version"], capture_output=True, text=True).stdout
    h.update((shutil.which(real) or real).encode())
    h.update(version.encode())
    for i, a in enumerate(args):
        if i == out_at:
            continue  # the output path says nothing about the output
        if os.path.isfile(a):
            with open(a, "rb") as f:
                h.update(b"file:" + hashlib.sha256(f.read()).digest())
        else:
            h.update(b"arg:" + a.encode())
        h.update(b"\0")
    return h.hexdigest()


def _copy_atomically(src: str, dst: str) -> None:
    """src's bytes and mode at dst, never half there: a copy in dst's directory, then a rename."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(dst)), suffix=".tmp")
    os.close(fd)
    shutil.copy(src, tmp)
    os.replace(tmp, dst)


def main(argv: list[str]) -> int:
    real = os.environ.get("DFLASH_TEST_CXX") or "g++"
    cache = os.environ.get("DFLASH_TEST_CXX_CACHE")
    out_at = argv.index("-o") + 1 if "-o" in argv else len(argv)
    if not cache or out_at >= len(argv) or not argv[out_at].endswith(".so") or "-E" in argv:
        os.execvp(real, [real, *argv])  # version probes, -E, precompiled headers: untouched
    out = argv[out_at]
    os.makedirs(cache, exist_ok=True)
    kept = os.path.join(cache, _key(real, argv, out_at) + ".so")
    if os.path.isfile(kept):
        _copy_atomically(kept, out)
        return 0
    rc = subprocess.run([real, *argv]).returncode
    if rc == 0 and os.path.isfile(out):
        _copy_atomically(out, kept)  # two workers that built the same object both keep it: same bytes
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
