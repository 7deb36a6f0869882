"""Thin Prefect wrappers for node health, and the per-node table the UI shows."""

import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor, wait

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tasks.health.accounting import Fleet, fleet
from tasks.health.actions import DrainPlan
from tasks.health.burn_in import BurnIn, burn_in
from tasks.health.run import HealthRun, resolve_nodes
from tasks.health.sweep import Sweep, sweep

_PROGRESS_EVERY_SECONDS = 1.0


@task(name="health-sweep")
def sweep_task(settings, only: list[str] | None, level: int | None, admit: bool) -> Sweep:
    """The whole sweep in one task (never a task per node on a large fleet), with a progress
    artifact: the sweep runs in a helper thread while this (the task's) thread, which owns the
    Prefect context, updates the artifact as nodes finish. The helper runs in a copy of that
    context: a Secret block it loads comes from this run's server, never a temporary one."""
    total = max(1, len(resolve_nodes(settings, only)))
    artifact = create_progress_artifact(progress=0.0, description=f"checking {total} nodes")
    done, lock = [0], threading.Lock()

    def finished(report) -> None:
        with lock:
            done[0] += 1
        print(f"{report.node}: {report.verdict.value} {report.summary}")

    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(contextvars.copy_context().run, sweep, settings, only, level, admit, finished)
        while not wait([future], timeout=_PROGRESS_EVERY_SECONDS).done:
            update_progress_artifact(artifact, progress=100.0 * done[0] / total)
    update_progress_artifact(artifact, progress=100.0)
    return future.result()


def node_rows(run: HealthRun) -> list[dict]:
    rows = []
    for r in sorted(run.reports, key=lambda r: (-r.verdict.rank, r.node)):
        worst = r.worst_check
        evidence = worst.evidence[0] if worst and worst.evidence else None
        rows.append(
            {
                "node": r.node,
                "verdict": r.verdict.value,
                "check": worst.name if worst else "",
                "evidence": r.summary,
                "gpu": getattr(evidence, "gpu", None),
                "error id": getattr(evidence, "error_id", None),
                "severity": getattr(evidence, "severity", None),
                "busbw / gate": f"{evidence.value:g} / {evidence.gate:g}"
                if evidence and evidence.value is not None and evidence.gate is not None
                else "",
                "raw": worst.raw if worst else "",
                "seconds": round(r.seconds, 2),
            }
        )
    return rows


def plan_markdown(run: HealthRun, plan: DrainPlan, settings, spares: dict[str, str]) -> str:
    lines = [
        f"# node health (level {run.level}): {len(run.reports)} nodes in {run.seconds:.1f} s",
        "",
        "Verdicts: " + ", ".join(f"{v} {n}" for v, n in sorted(run.counts().items())),
        "",
    ]
    if plan.page:
        lines.append(f"**PAGE: {plan.page}**")
    verb = (
        "drained" if settings.drain.enabled and not plan.page else "to drain (draining is off: a plan only)"
    )
    lines += [f"- {verb}: " + (", ".join(f"{n} ({why})" for n, why in plan.drain) or "none")]
    lines += [f"- held: {n} ({why})" for n, why in plan.held]
    if plan.rerun:
        lines.append(f"- rerun (tool errors, not drained): {', '.join(plan.rerun)}")
    lines += [f"- spare {node}: {state}" for node, state in spares.items()]
    return "\n".join(lines) + "\n"


@task(name="publish-health")
def publish_health(run: HealthRun, plan: DrainPlan, settings, spares: dict[str, str]) -> None:
    create_table_artifact(
        table=node_rows(run), key="node-health", description="verdict per node, worst first"
    )
    create_markdown_artifact(
        markdown=plan_markdown(run, plan, settings, spares),
        key="node-health-actions",
        description="drains, held nodes, reruns, spares",
    )


@task(name="burn-in")
def burn_in_task(settings, nodes: list[str] | None) -> BurnIn:
    return burn_in(settings, nodes)


@task(name="fleet")
def fleet_task(settings) -> Fleet:
    """The fleet's places (tasks.health.accounting), as the ``fleet`` table artifact."""
    found = fleet(settings)
    create_table_artifact(table=[n.to_dict() for n in found.nodes], key="fleet", description=found.summary())
    return found
