"""dflashctl: build, cache, launch and watch DFlash training jobs. Never imports torch."""

__version__ = "0.1.0"
