"""A health sweep: the one composition of node health that the CLI and the flow both run.

Resolve the nodes, check them all (bounded in parallel, tasks.health.run), decide the drains
and apply them as the profile allows (tasks.health.actions), and tell which spares are ready.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from tasks.cluster import slurm
from tasks.health import nvrx
from tasks.health.actions import DrainPlan, Readiness, apply_drains, plan_drains, spare_readiness
from tasks.health.history import record_admitted, record_suspect
from tasks.health.run import HealthRun, NodeReport, resolve_nodes, run_health

# sinfo's short states of a node held out of service (drained, draining, down).
HELD_STATES = ("drain", "drng", "down")


@dataclass
class Sweep:
    run: HealthRun
    plan: DrainPlan
    spares: dict[str, str]
    returned: list[str] = field(default_factory=list)  # ready spares put back into service
    segments: nvrx.SegmentUpdate | None = None  # NVRx's exclusion files, with health.nvrx_segment_dir

    @property
    def exit_code(self) -> int:
        """0 when every node may run jobs; 1 otherwise, when a human was paged, or when NVRx's
        exclusion files could not be brought up to date."""
        worst = max((r.verdict.exit_code for r in self.run.reports), default=0)
        return 1 if self.plan.page or (self.segments and self.segments.errors) else worst

    def message(self) -> str:
        counts = ", ".join(f"{v} {n}" for v, n in sorted(self.run.counts().items()))
        if self.plan.page:
            return f"PAGE: {self.plan.page}"
        bad = [f"{r.node} {r.verdict.value}: {r.summary}" for r in self.run.reports if r.verdict.exit_code]
        segments = self.segments.message() if self.segments else ""
        return (
            f"{len(self.run.reports)} nodes: {counts}"
            + (f"; {'; '.join(bad)}" if bad else "")
            + (f"; {segments}" if segments else "")
        )


def sweep(
    settings,
    only: list[str] | None = None,
    level: int | None = None,
    admit: bool = False,
    progress: Callable[[NodeReport], None] | None = None,
    reason: str | None = None,
    incident: str | None = None,
) -> Sweep:
    """Check the profile's nodes (or ``only``), drain what the verdicts and the caps allow (with
    ``reason``, e.g. a recovery's incident, as Slurm's drain reason), and judge the spares;
    ``admit`` runs the spare admission set on the nodes given and puts the ready ones that Slurm
    holds out of service back into it, and starts their suspect history afresh. ``incident``
    (a recovery's incident id) records the nodes as its suspects in their history first: a
    repeat suspect fails this very sweep. With ``health.nvrx_segment_dir`` and
    ``health.nvrx_exclusion_dir``, NVRx's exclusion files follow the verdicts (tasks.health.nvrx)."""
    names = resolve_nodes(settings, only)
    if incident:
        for node in names:
            record_suspect(settings.raw_dir, node, incident, reason or "")
    run = run_health(settings, names, level, admit, progress)
    plan = apply_drains(plan_drains(run.reports, settings, reason=reason), settings)
    spares = spare_readiness(run.reports, names if admit else settings.spares, run.level)
    if admit:
        for node, state in spares.items():
            if state == Readiness.READY:
                record_admitted(settings.raw_dir, node)
    segments = nvrx.publish(run.reports, settings) if settings.nvrx_segment_dir else None
    if settings.nvrx_exclusion_dir:
        exclusions = nvrx.publish_for(settings)
        segments = segments or nvrx.SegmentUpdate()
        segments.written += exclusions.written
        segments.removed += exclusions.removed
        segments.errors += exclusions.errors
    return Sweep(run, plan, spares, return_to_service(spares, settings) if admit else [], segments)


def return_to_service(readiness: dict[str, str], settings) -> list[str]:
    """Resume in Slurm the ready spares it holds out of service, when ckptops manages the nodes'
    Slurm state (``health.drain.enabled``; otherwise nothing in Slurm is changed)."""
    if not settings.drain.enabled:
        return []
    back = []
    for node, verdict in readiness.items():
        if verdict == Readiness.READY and slurm.node_state(node) in HELD_STATES:
            slurm.resume(node)
            back.append(node)
    return back
