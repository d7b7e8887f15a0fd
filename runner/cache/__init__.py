"""Compile caches as versioned artifacts: store, snapshot, verify, restore, push/pull, warm.

Never imports torch: everything that needs torch runs as `python -m dflash.<entry>` in the
environment that uses the cache (see runner/exec/jobenv.py). Layout and trust model:
docs/compile-cache.md.
"""
