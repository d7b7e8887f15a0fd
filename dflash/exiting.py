"""Leaving a job process without the interpreter's last garbage collections.

At exit CPython clears every module and runs the cyclic collector over what is left; with torch and
transformers loaded that walks millions of objects: about 2.2 s of CPU for a process that imported
the drafter and 1 s for torch alone on the 2-core CI machine (0.25 s and 0.05 s with gc.freeze()
first). A job's processes exit one after another (drafters, torchrun, targets, the supervisor), so
without this every job ends seconds later than its work. Frozen objects are out of the collector's
reach only: atexit handlers, the flush of stdout and stderr and refcount-driven clean-up still run,
and what only a reference cycle keeps alive is left to the OS, as at os._exit. Everything a job must
finish (checkpoints, events, shared memory, process groups) is closed before its main returns.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def without_final_gc() -> Iterator[None]:
    """Around a process's `raise SystemExit(main())`: however it leaves, the collector is frozen."""
    try:
        yield
    finally:
        gc.freeze()
