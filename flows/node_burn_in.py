"""node-burn-in: the nodes ckptops drained come back only through a burn-in (tasks.health.burn_in),
scheduled (hourly in infra/prefect.yaml); the fleet's table (tasks.health.accounting) as an
artifact, and a notification when spares run short."""

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, Failed

from tasks.errors import UsageError
from tasks.health.flow_tasks import burn_in_task, fleet_task
from tasks.notify import send
from tasks.profile import load_profile


@flow(name="node-burn-in", log_prints=True)
def node_burn_in(profile: str = "local", nodes: list[str] | None = None):
    """Burn in the drained nodes of ckptops' own (or ``nodes``), return the ones that pass; the
    fleet's table; fails when a node failed its burn-in, is held for a person, or spares run short."""
    prof = load_profile(profile)
    if prof.health is None:
        raise UsageError(f"{prof.source}: no health section")
    done = burn_in_task(prof.health, nodes)
    lines = [o.line() for o in done.outcomes] or ["no node drained by ckptops is held out of service"]
    create_markdown_artifact(
        markdown="\n".join(f"- {line}" for line in lines) + "\n", key="node-burn-in", description="burn-ins"
    )
    found = fleet_task(prof.health)
    message = "; ".join([*lines, found.summary()])
    if found.spares_short:
        unsent = send(prof, "spares running out", found.spares_short)
        message += f"; {found.spares_short}" + (f"; {unsent}" if unsent else "")
    return Failed(message=message) if done.exit_code or found.spares_short else Completed(message=message)
