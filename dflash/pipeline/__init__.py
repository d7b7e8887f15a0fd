"""The multi-process pipeline: target worker processes feed a restartable drafter group (torchrun)
through the hidden-state transport in `dflash.pipeline.transport` (one shared-memory queue per host)."""
