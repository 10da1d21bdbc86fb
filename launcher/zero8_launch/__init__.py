"""zero8-launch: starts a zero8 (or any DeepSpeed-style) training script on one or many nodes through
OpenMPI's mpirun or SLURM's srun. Standard library only: it imports neither zero8 nor torch, so it starts
fast and works on hosts that only run ranks. docs/LAUNCH.md is the manual.
"""

from .hostfile import LaunchError, expand_hostlist, filter_resources, parse_hostfile, read_hostfile, select_resources

__all__ = ["LaunchError", "parse_hostfile", "read_hostfile", "filter_resources", "select_resources",
           "expand_hostlist"]
