"""DFlash drafter training job: drafter model, attention backends, objective, data, target capture,
checkpoints, metrics and the multi-process pipeline. Never imports `runner`."""

__version__ = "0.1.0"
