"""When the infrastructure, not the job, ended a Slurm job: then its recovery counts against no
budget (tasks.recovery.rules) and goodput reports its downtime apart (JobSet's policy that
infrastructure disruptions do not count against maxRestarts; Google's goodput exclusion windows).

Besides the lines triage reads (``DUE TO PREEMPTION``, a cloud's preemption notice), Slurm itself
says so:
- the job's state is ``PREEMPTED``;
- the job was cancelled, or its node failed, while a maintenance reservation (``Flags=MAINT``)
  held one of its nodes: the site took the node for maintenance;
- the job was cancelled while ckptops itself had drained one of its nodes during its run (its
  drain log): the planned swap of a node for a spare, not a failure of the job.

A job that crashed (``FAILED``, ``OUT_OF_MEMORY``, ``TIMEOUT``) is the job's own failure, whatever
happened to its nodes.
"""

import time
from pathlib import Path

from tasks.cluster import slurm
from tasks.errors import CkptopsError
from tasks.recovery.job import SlurmJob, slurm_job
from tasks.storage.local import read_own_jsonl

_ENDING = ("RUNNING", "COMPLETING", "CONFIGURING", "STOPPED", "SUSPENDED")
_POLL_SECONDS = 1.0
# Slack for the clocks of slurmctld and of the host ckptops drained from.
_SLACK_SECONDS = 60.0


def _final(job: SlurmJob, wait_seconds: float) -> SlurmJob:
    """The job once Slurm has its end (a recovery the job's own script or epilog triggers may
    look while it still runs or completes), within ``wait_seconds``."""
    deadline = time.monotonic() + wait_seconds
    while job.state in _ENDING and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
        job = slurm_job(job.id)
    return job


def taken_away(job: SlurmJob, drain_log: Path | None, wait_seconds: float = 30.0) -> str | None:
    """Why the infrastructure ended ``job`` (one line), or None when it did not say so (or the job
    has not ended within ``wait_seconds``, or Slurm or the drain log could not be read: the
    failure then counts as the job's own, as before this was asked)."""
    try:
        return _taken_away(_final(job, wait_seconds), drain_log)
    except CkptopsError:  # UsageError and Unreadable among them
        return None


def _taken_away(job: SlurmJob, drain_log: Path | None) -> str | None:
    if job.state == "PREEMPTED":
        return f"Slurm job {job.id}: JobState=PREEMPTED (Reason={job.reason or 'None'})"
    if job.state not in ("CANCELLED", "NODE_FAIL"):
        return None
    start, end = slurm.slurm_time(job.start_time), slurm.slurm_time(job.end_time)
    if end is None:
        return None
    for r in slurm.reservations():
        held = sorted(set(r.nodes) & set(job.nodes))
        if "MAINT" in r.flags and held and r.start - _SLACK_SECONDS <= end <= r.end:
            return (
                f"Slurm job {job.id} {job.state} while maintenance reservation {r.name} held "
                f"{', '.join(held)}"
            )
    if job.state != "CANCELLED" or drain_log is None or start is None:
        return None
    for entry in read_own_jsonl(drain_log, lambda e: isinstance(e.get("at"), (int, float))):
        if entry.get("node") in job.nodes and start <= entry["at"] <= end + _SLACK_SECONDS:
            return (
                f"Slurm job {job.id} cancelled after ckptops drained {entry['node']} during its run "
                f"({entry.get('reason', '')[:120]}): a planned swap"
            )
    return None
