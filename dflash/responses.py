"""`python -m dflash.responses`: the target's responses as training data, now dflash.data.responses (this name kept for the command).

Runs that module as the program, so every documented command line keeps working; code imports
dflash.data.responses itself."""

import runpy

if __name__ == "__main__":
    runpy.run_module("dflash.data.responses", run_name="__main__", alter_sys=True)
