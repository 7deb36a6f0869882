"""node-health: DCGM diagnostics, GPU basics and nccl-tests over a profile's nodes, verdicts with
evidence, and the drains (or the drain plan) that follow from them. ``admit=True`` runs the spare
admission set (r3, single-node NCCL, a pair test with a known-good node) on the given nodes."""

from prefect import flow
from prefect.states import Completed, Failed

from tasks.errors import UsageError
from tasks.health.flow_tasks import publish_health, sweep_task
from tasks.notify import send
from tasks.profile import load_profile


@flow(name="node-health", log_prints=True)
def node_health(
    profile: str = "local", nodes: list[str] | None = None, level: int | None = None, admit: bool = False
):
    prof = load_profile(profile)
    if prof.health is None:
        raise UsageError(f"{prof.source}: no health section")
    done = sweep_task(prof.health, nodes, level, admit)
    publish_health(done.run, done.plan, prof.health, done.spares)
    message = done.message()
    if done.plan.page:
        unsent = send(prof, "node health: stop and page", message)
        message += f"; {unsent}" if unsent else ""
    return Failed(message=message) if done.exit_code else Completed(message=message)
