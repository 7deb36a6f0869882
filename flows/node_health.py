"""node-health: DCGM diagnostics, GPU basics and nccl-tests over a profile's nodes, verdicts with
evidence, and the drains (or the drain plan) that follow from them. ``admit=True`` runs the spare
admission set (r3, single-node NCCL, a pair test with a known-good node) on the given nodes."""

import time

from prefect import flow
from prefect.states import Completed, Failed

from tasks.errors import UsageError
from tasks.health.actions import spare_readiness
from tasks.health.flow_tasks import check_batch, drain_task, nodes_task, publish_health
from tasks.health.run import HealthRun
from tasks.profile import load_profile


@flow(name="node-health", log_prints=True)
def node_health(
    profile: str = "local", nodes: list[str] | None = None, level: int | None = None, admit: bool = False
):
    prof = load_profile(profile)
    settings = prof.health
    if settings is None:
        raise UsageError(f"{prof.source}: no health section")
    names = nodes_task(settings, nodes)
    # One batch at a time, each as wide as the profile's concurrency: never more nodes at once.
    batches = [names[i : i + settings.concurrency] for i in range(0, len(names), settings.concurrency)]
    started = time.monotonic()
    reports = [r for b in batches for r in check_batch(settings, b, len(b) - 1, level, admit)]
    run = HealthRun(reports, 3 if admit else (level or settings.level), time.monotonic() - started)
    plan = drain_task(settings, reports)
    spares = spare_readiness(reports, names if admit else settings.spares, run.level)
    publish_health(run, plan, settings, spares)
    bad = [f"{r.node} {r.verdict.value}: {r.summary}" for r in reports if r.verdict.exit_code]
    message = f"{len(reports)} nodes: " + ", ".join(f"{v} {n}" for v, n in sorted(run.counts().items()))
    if plan.page:
        return Failed(message=f"PAGE: {plan.page}")
    return Failed(message=f"{message}; " + "; ".join(bad)) if bad else Completed(message=message)
