"""What to do about the verdicts: drain failing nodes in Slurm (safely), admit spares.

Safety rules (as operators' health-check suites apply them: Azure HPC health checks, Meta GCM):
- many nodes failing the same check at once is usually a software regression, not hardware:
  drain nothing, call a human (``page``);
- at most ``max_per_run`` drains per run and ``max_per_hour`` per hour (a drain log per fleet);
- only FAIL_HARDWARE and FAIL_CONFIG nodes are drained; SUSPECT and TOOL_ERROR nodes are listed
  for a rerun, never drained on a tool's word.
With draining off, the same decisions make a drain plan for a human.
"""

import time
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from tasks.cluster import slurm
from tasks.health.run import NodeReport
from tasks.health.verdict import CheckName
from tasks.outcome import Verdict
from tasks.storage.local import append_private_jsonl, read_jsonl

DRAIN_LOG = "drains.jsonl"
_REASON_LIMIT = 200


@dataclass
class DrainPlan:
    drain: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    held: list[tuple[str, str]] = field(default_factory=list)  # (node, why not drained)
    rerun: list[str] = field(default_factory=list)  # SUSPECT / TOOL_ERROR nodes
    page: str | None = None
    drained: list[str] = field(default_factory=list)


def _reason(report: NodeReport) -> str:
    return f"ckptops {report.verdict.value} {report.summary}"[:_REASON_LIMIT]


def _drained_in_last_hour(raw_dir: Path, now: float) -> list[str]:
    """The nodes the drain log says were drained within the hour. Read whoever wrote it: a line
    another account added can only hold a drain back, never make one (the burn-in, which resumes
    nodes, trusts the log only as ckptops's own)."""
    recent = []
    for entry in read_jsonl(Path(raw_dir) / DRAIN_LOG):
        try:
            if now - entry["at"] < 3600:
                recent.append(entry["node"])
        except (KeyError, TypeError):
            continue  # not a drain entry
    return recent


def plan_drains(
    reports: list[NodeReport], settings, now: float | None = None, reason: str | None = None
) -> DrainPlan:
    """The drains the verdicts and the caps allow. ``reason``: Slurm's drain reason for every
    node (a recovery names its incident), else each node's worst check."""
    now = time.time() if now is None else now
    plan = DrainPlan()
    failing = [r for r in reports if r.verdict.is_failure]
    plan.rerun = [r.node for r in reports if r.verdict in (Verdict.SUSPECT, Verdict.TOOL_ERROR)]
    by_check = Counter(r.worst_check.name for r in failing)
    crowded = [(check, n) for check, n in by_check.items() if n >= settings.drain.page_when_same_check_fails]
    if crowded:
        check, n = max(crowded, key=lambda c: c[1])
        plan.page = (
            f"{n} nodes fail {check} at once: likely a software or fabric regression, not {n} bad "
            f"nodes; nothing drained, a human must look"
        )
        plan.held = [(r.node, "held: stop-and-page") for r in failing]
        return plan
    recent = _drained_in_last_hour(settings.raw_dir, now)
    budget = min(settings.drain.max_per_run, max(0, settings.drain.max_per_hour - len(recent)))
    for report in sorted(failing, key=lambda r: -r.verdict.rank):
        if report.node in recent:
            plan.held.append((report.node, "already drained within the hour"))
        elif len(plan.drain) < budget:
            plan.drain.append((report.node, reason[:_REASON_LIMIT] if reason else _reason(report)))
        else:
            plan.held.append((report.node, "held: drain cap reached (per run or per hour)"))
    return plan


def apply_drains(plan: DrainPlan, settings, now: float | None = None) -> DrainPlan:
    """Drain the planned nodes when the profile allows it; log every drain (the drain log,
    created 0600: the burn-in trusts it only as ckptops's own)."""
    if not settings.drain.enabled or plan.page:
        return plan
    log = Path(settings.raw_dir) / DRAIN_LOG
    for node, reason in plan.drain:
        slurm.drain(node, reason)
        plan.drained.append(node)
        append_private_jsonl(log, {"at": time.time() if now is None else now, "node": node, "reason": reason})
    return plan


class Readiness(StrEnum):
    """A spare's answer: ``ready``, or ``not ready: <why>``."""

    READY = "ready"
    NOT_READY = "not ready"


def spare_readiness(reports: list[NodeReport], spares: list[str], level: int) -> dict[str, str]:
    """A spare is ready only if its admission run (r3, single-node NCCL, pair test) all passed."""
    ready = {}
    for report in reports:
        if report.node not in spares:
            continue
        names = {c.name for c in report.checks}
        complete = (
            level >= 3
            and {CheckName.DCGM_DIAG, CheckName.NCCL} <= names
            and any(n.startswith(f"{CheckName.NCCL_PAIR}-") for n in names)
        )
        if not complete:
            ready[report.node] = f"{Readiness.NOT_READY}: the admission set did not run completely"
        elif report.verdict in (Verdict.PASS, Verdict.WARN):
            ready[report.node] = Readiness.READY
        else:
            ready[report.node] = f"{Readiness.NOT_READY}: {report.summary}"
    return ready
