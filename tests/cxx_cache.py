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

conftest.py points CXX at a script named as the real compiler (`g++`) that runs this file
(inductor reads CXX, and tells gcc from clang by that name) and the cache at a session temp dir (DFLASH_TEST_CXX_CACHE); DFLASH_TEST_CXX names
the real compiler. DFLASH_TEST_CXX_CACHE=off runs the tests without it. Product code never uses it:
the job and the runner compile with whatever CXX the user has.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile


def _real() -> str:
    return os.environ.get("DFLASH_TEST_CXX") or "g++"


def _key(real: str, args: list[str], out_at: int) -> str:
    h = hashlib.sha256()
    version = subprocess.run([real, "--version"], capture_output=True, text=True).stdout
    h.update(shutil.which(real).encode() if shutil.which(real) else real.encode())
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


def main(argv: list[str]) -> int:
    real = _real()
    cache = os.environ.get("DFLASH_TEST_CXX_CACHE")
    if not cache or "-o" not in argv or not argv[argv.index("-o") + 1 :][:1]:
        os.execvp(real, [real, *argv])
    out_at = argv.index("-o") + 1
    out = argv[out_at]
    if not out.endswith(".so") or "-E" in argv:
        os.execvp(real, [real, *argv])
    os.makedirs(cache, exist_ok=True)
    kept = os.path.join(cache, _key(real, argv, out_at) + ".so")
    if os.path.isfile(kept):
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(out)), suffix=".tmp")
        os.close(fd)
        shutil.copy(kept, tmp)  # with its mode, as g++ wrote it
        os.replace(tmp, out)
        return 0
    rc = subprocess.run([real, *argv]).returncode
    if rc == 0 and os.path.isfile(out):
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".tmp")
        os.close(fd)
        shutil.copy(out, tmp)
        os.replace(tmp, kept)  # two workers that built the same object both keep it: same bytes
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
