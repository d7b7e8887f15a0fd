"""The multi-process pipeline: target worker processes feed a restartable drafter group (torchrun)
through the hidden-state transport in `dflash.pipeline.transport` (one shared-memory queue per host). The supervisor (dflash.pipeline.supervisor) starts them."""

from __future__ import annotations

DATA_SUMMARY_ENV = "DFLASH_DATA_SUMMARY"
"""Set by the launcher for the drafter group: the data counts (TokenizedDataset.summary, JSON) of the
data the targets read, for the drafter group's `started` event (the drafters read no data)."""

STOP_FILE_ENV = "DFLASH_STOP_FILE"
"""Set by the launcher for torchrun: a file that exists while the job is being stopped; torchrun
restarts no failed drafter group then (dflash.pipeline.torchrun)."""
