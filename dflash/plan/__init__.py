"""Deciding before running: what a job will do on this machine, as data, before any worker starts.

builder.py builds the one JobPlan from the pieces: shapes.py (every shape and compiled graph),
spec.py (the drafter's sizes), resolve.py (device, attention, kernels, dtypes, threads),
placement.py (where the workers go and whether they fit), spares.py (the spare drafters) and
hosts.py (the rendezvous and each host's role). Nothing here imports from dflash.plan.builder itself.
"""
