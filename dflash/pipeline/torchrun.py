"""torchrun as the launcher starts it: `python -m torch.distributed.run`'s own main and command line,
leaving without the interpreter's last garbage collections like the job's other processes
(dflash.exiting): the supervisor sees the drafter group's end only once this process has exited.

    python -m dflash.pipeline.torchrun [torchrun options] -m dflash.pipeline.drafter_worker ...
"""

from __future__ import annotations

from torch.distributed.run import main

from dflash.exiting import without_final_gc

if __name__ == "__main__":
    with without_final_gc():
        main()
