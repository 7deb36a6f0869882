"""Slurm from the host ckptops runs on: which nodes a partition or nodelist names, and draining.

Every call is an argv list with a timeout (never a shell string): a node name or a reason can
only ever be one argument.
"""

import subprocess

from tasks.cluster.transport import check_node_name
from tasks.errors import CkptopsError

TIMEOUT_SECONDS = 30


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
    except FileNotFoundError:
        raise CkptopsError(
            f"{argv[0]}: not installed on this host (Slurm commands are needed here)"
        ) from None
    except subprocess.TimeoutExpired:
        raise CkptopsError(f"{' '.join(argv[:2])}: no answer within {TIMEOUT_SECONDS}s") from None
    if done.returncode != 0:
        raise CkptopsError(f"{' '.join(argv[:2])}: exited {done.returncode}: {done.stderr.strip()[:200]}")
    return done.stdout


def expand_nodelist(nodelist: str) -> list[str]:
    """``gpu[001-004]`` -> the node names, as Slurm itself expands them."""
    return [check_node_name(n) for n in _run(["scontrol", "show", "hostnames", nodelist]).split()]


def partition_nodes(partition: str) -> list[str]:
    return sorted(
        {check_node_name(n) for n in _run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N"]).split()}
    )


def drain(node: str, reason: str) -> None:
    _run(["scontrol", "update", f"NodeName={check_node_name(node)}", "State=DRAIN", f"Reason={reason}"])
