"""`python -m dflash.fingerprint`: the compile-cache fingerprint, now dflash.cache.fingerprint (this name kept for the command).

Runs that module as the program, so every documented command line keeps working; code imports
dflash.cache.fingerprint itself."""

import runpy

if __name__ == "__main__":
    runpy.run_module("dflash.cache.fingerprint", run_name="__main__", alter_sys=True)
