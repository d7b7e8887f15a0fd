"""`python -m dflash.warm`: warm-cache's job side, now dflash.cache.warm (this name kept for the command).

Runs that module as the program, so every documented command line keeps working; code imports
dflash.cache.warm itself."""

import runpy

if __name__ == "__main__":
    runpy.run_module("dflash.cache.warm", run_name="__main__", alter_sys=True)
