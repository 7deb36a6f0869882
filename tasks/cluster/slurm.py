"""Slurm from the host ckptops runs on: which nodes a partition or nodelist names, and draining.

Every call is an argv list with a timeout (never a shell string): a node name or a reason can
only ever be one argument.
"""

import re
from dataclasses import dataclass
from datetime import datetime

from tasks.cluster.process import capture
from tasks.cluster.transport import check_node_name
from tasks.errors import CkptopsError, UsageError

TIMEOUT_SECONDS = 30


def run(argv: list[str], timeout: float = TIMEOUT_SECONDS) -> str:
    """A Slurm command's output; one line naming the command when it is missing (a usage error:
    this host needs Slurm's commands), silent, or refusing."""
    done = capture(argv, timeout)
    if done.exit_code == 127:
        raise UsageError(f"{argv[0]}: not installed on this host (Slurm commands are needed here)")
    if done.timed_out:
        raise CkptopsError(f"{' '.join(argv[:2])}: no answer within {timeout:.0f}s")
    if done.exit_code != 0:
        raise CkptopsError(f"{' '.join(argv[:2])}: exited {done.exit_code}: {done.stderr.strip()[:200]}")
    return done.stdout


def expand_nodelist(nodelist: str) -> list[str]:
    """``gpu[001-004]`` -> the node names, as Slurm itself expands them."""
    return [check_node_name(n) for n in run(["scontrol", "show", "hostnames", nodelist]).split()]


def partition_nodes(partition: str) -> list[str]:
    return sorted(
        {check_node_name(n) for n in run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N"]).split()}
    )


_IN_SERVICE = ("idle", "mix", "alloc", "comp")


def usable_nodes(partition: str | None, exclude=()) -> list[str]:
    """The partition's (default: every partition's) nodes in service, not drained, draining or
    down, and not excluded."""
    argv = ["sinfo", "-h", "-N", "-o", "%N %t", *(["-p", partition] if partition else [])]
    usable = []
    for line in run(argv).splitlines():
        node, state = line.split()
        if state.rstrip("*~#!%$@^-") in _IN_SERVICE and node not in exclude:
            usable.append(check_node_name(node))
    return sorted(set(usable))


def node_state(node: str) -> str:
    """Slurm's state of one node, lower case as sinfo prints it (idle, drain, drng, down, mix...)."""
    return run(["sinfo", "-h", "-N", "-n", check_node_name(node), "-o", "%t"]).strip().rstrip("*~#!%$@^-")


def node_statuses(nodes: list[str] | None = None) -> dict[str, tuple[str, str]]:
    """Slurm's state (as ``node_state``) and reason ('' without one) of ``nodes`` (default:
    every node), in one call."""
    argv = ["sinfo", "-h", "-N", "-o", "%N|%t|%E"]
    if nodes:
        argv += ["-n", ",".join(check_node_name(n) for n in nodes)]
    found = {}
    for line in run(argv).splitlines():
        node, _, rest = line.partition("|")
        state, _, reason = rest.partition("|")
        reason = reason.strip()
        found[node.strip()] = (state.strip().rstrip("*~#!%$@^-"), "" if reason == "none" else reason)
    return found


def node_status(node: str) -> tuple[str, str]:
    return node_statuses([node]).get(check_node_name(node), ("unknown", ""))


def resume(node: str) -> None:
    run(["scontrol", "update", f"NodeName={check_node_name(node)}", "State=RESUME"])


def drain(node: str, reason: str) -> None:
    run(["scontrol", "update", f"NodeName={check_node_name(node)}", "State=DRAIN", f"Reason={reason}"])


@dataclass(frozen=True)
class Reservation:
    name: str
    nodes: tuple[str, ...]
    start: float  # epoch seconds (slurmctld prints its local time; read as this host's)
    end: float
    flags: frozenset[str]


def fields(text: str) -> dict[str, str]:
    """``scontrol show ... -o``'s one line of Key=Value pairs (values may hold spaces only in
    the trailing Command/WorkDir-like keys, which we do not rely on)."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


def slurm_time(text: str | None) -> float | None:
    """``2026-12-06T23:03:16`` (Slurm's local time) as epoch seconds; None for Unknown, None."""
    try:
        return datetime.fromisoformat(text).timestamp() if text else None
    except ValueError:
        return None


def reservations() -> list[Reservation]:
    """Every reservation slurmctld has, with its nodes expanded."""
    found = []
    for line in run(["scontrol", "show", "reservation", "-o"]).splitlines():
        f = fields(line)
        start, end = slurm_time(f.get("StartTime")), slurm_time(f.get("EndTime"))
        if "ReservationName" not in f or start is None or end is None:
            continue  # "No reservations in the system"
        nodes = f.get("Nodes", "")
        found.append(
            Reservation(
                f["ReservationName"],
                tuple(expand_nodelist(nodes)) if nodes and nodes != "(null)" else (),
                start,
                end,
                frozenset(f.get("Flags", "").split(",")),
            )
        )
    return found
