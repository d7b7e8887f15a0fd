"""Where and how commands run: the job environment (jobenv), this machine or a host over ssh
(remote), the docker CLI (docker), the one subprocess line streamer (stream) and process identity
and kill-tree (proc). Everything a launcher and the cache feature share."""
