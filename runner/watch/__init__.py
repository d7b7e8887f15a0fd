"""`dflashctl watch`: a live health monitor over the run directory, NVML and the workers' processes.

    sampler (on the GPU host) --JSON lines--> Watcher: History -> Snapshot -> detectors -> findings
                                                                      +-> dashboard / snapshot_json

nvml.py, fakenvml.py, procinfo.py and sampler.py use only the standard library (plus pynvml and
psutil when present): bundle.py ships them to the GPU host as one program for `python3 -` over
ssh. Nothing here imports torch or dflash; only dashboard.py imports rich.
"""
