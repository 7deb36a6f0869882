"""Thin Prefect wrappers for the recovery run: each phase as a task, the approval form on a
paused flow run, the incident's artifacts and events."""

from typing import Literal

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput

from tasks.events import CAUSE_LABEL, RECOVERY_COMPLETED, RECOVERY_STARTED, RECOVERY_STOPPED, job_resource
from tasks.recovery.ledger import Incident, IncidentOutcome, incidents
from tasks.recovery.report import incident_rows, incidents_markdown, plan_markdown
from tasks.recovery.run import Decision, RecoveryPlan


def flow_step(name: str, fn, *args, **kwargs):
    """Run one phase as a task of its own, so the UI shows each phase, its time and its error.
    Its inputs (profiles, triage results) are not cached on."""
    return task(fn, name=name, cache_policy=NO_CACHE)(*args, **kwargs)


class Approval(RunInput):
    decision: Literal["approve", "abort"] = "approve"
    checkpoint: int | None = None  # another verified checkpoint than the proposed one
    note: str = ""


def ask_in_ui(timeout_seconds: float):
    """An approver for ``recover``: pause the flow run with the plan as the form's description;
    nobody answering in time is a no."""

    def approve(plan: RecoveryPlan) -> Decision:
        form = Approval.with_initial_data(
            description=plan_markdown(plan), decision="approve", checkpoint=plan.checkpoint
        )
        try:
            answer = pause_flow_run(wait_for_input=form, timeout=int(timeout_seconds), poll_interval=2)
        except FlowPauseTimeout:
            return Decision(
                False, f"no answer within recovery.approval_timeout_seconds ({timeout_seconds:.0f}s)"
            )
        return Decision(answer.decision == "approve", "approver in the UI", answer.checkpoint, answer.note)

    return approve


def announce(job: str, incident: Incident, source: dict) -> None:
    """The recovery holds the job (triaged): whose failure it is, on the event's resource."""
    cause = "infrastructure" if incident.infrastructure else "job"
    emit_event(
        event=RECOVERY_STARTED,
        resource={"prefect.resource.id": job_resource(job), CAUSE_LABEL: cause},
        payload={"incident": incident.id, **source},
    )


@task(name="publish-incident", cache_policy=NO_CACHE)
def publish_incident(save_dir, incident: Incident) -> None:
    found = [i for i in incidents(save_dir) if i.job == incident.job]
    create_table_artifact(
        table=incident_rows(found),
        key=f"incidents-{incident.job}",
        description=f"incidents of {incident.job}",
    )
    create_markdown_artifact(
        key=f"incident-timeline-{incident.job}",
        markdown=incidents_markdown(incident.job, found),
        description=f"{incident.id}: {incident.outcome}",
    )
    emit_event(
        event=RECOVERY_COMPLETED if incident.outcome == IncidentOutcome.COMPLETED else RECOVERY_STOPPED,
        resource={"prefect.resource.id": job_resource(incident.job)},
        payload={
            "incident": incident.id,
            "class": incident.cls,
            "outcome": incident.outcome,
            "reason": incident.reason,
            "checkpoint": incident.checkpoint,
            "relaunched_job": incident.relaunched_job,
        },
    )
