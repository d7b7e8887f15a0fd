"""DFlash drafter training job: drafter model, attention backends, objective, data, target capture,
checkpoints, metrics and the multi-process pipeline. Never imports `runner`."""

__version__ = "0.1.0"

import os as _os

# Before torch initialises CUDA in any job process (every entry point imports this package first):
# growable segments, so that batches of several length buckets in one process do not fragment the
# caching allocator (measured on the H200: the 8B drafter's 8 buckets reserved up to 136 GiB with
# fixed segments). A setting of the user's own is kept.
if not (_os.environ.get("PYTORCH_ALLOC_CONF") or _os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
    _os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
