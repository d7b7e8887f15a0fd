"""dflashctl: build, check and cache the environments of DFlash training jobs. Never imports torch."""

__version__ = "0.1.0"
