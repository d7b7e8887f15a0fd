"""The compile cache, the job's side: where inductor writes and whether it was warm (job_side.py),
the key of what it compiles (fingerprint.py), and warming it ahead of a job (warm.py).
Nothing here imports from dflash.cache itself.
"""
