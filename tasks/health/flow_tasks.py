"""Thin Prefect wrappers for node health, and the per-node table the UI shows."""

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.health.actions import DrainPlan, apply_drains, plan_drains
from tasks.health.run import HealthRun, NodeReport, resolve_nodes, run_health


@task(name="resolve-nodes")
def nodes_task(settings, only: list[str] | None) -> list[str]:
    return resolve_nodes(settings, only)


@task(name="check-nodes", task_run_name="check-{nodes[0]}-and-{count}-more")
def check_batch(settings, nodes: list[str], count: int, level: int | None, admit: bool) -> list[NodeReport]:
    """One task per batch of nodes (never one per node on a large fleet); the nodes of a batch
    are checked in parallel inside it."""
    return run_health(settings, nodes, level, admit).reports


@task(name="drains")
def drain_task(settings, reports: list[NodeReport]) -> DrainPlan:
    return apply_drains(plan_drains(reports, settings), settings)


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
