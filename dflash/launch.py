"""`python -m dflash.launch`: the job's supervisor, now dflash.pipeline.supervisor (this name kept for the command).

Runs that module as the program, so every documented command line keeps working; code imports
dflash.pipeline.supervisor itself."""

import runpy

if __name__ == "__main__":
    runpy.run_module("dflash.pipeline.supervisor", run_name="__main__", alter_sys=True)
