"""Cluster access: SSH to nodes, commands on this host, Slurm."""
