"""`dflashctl run`: plan a launch as plain data (plan.py), check every host before anything starts
(preflight.py), then apply it (apply.py) through one backend (tmux.py, docker.py, foreground.py).
Every launched run is recorded in a small local registry (registry.py) that ps/logs/stop/attach
read to find it again, on this machine or on a host."""
