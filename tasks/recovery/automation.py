"""The job's recovery automations on the Prefect server, installed once per job
(``ckptops automations --deployment recovery-run/<job>-recovery``):

- the failure-storm guard pauses the automatic recovery deployment when more than
  ``recovery.max_per_hour`` recoveries of the job's own failures start within an hour (each
  recovery's ``training.recovery.started``, labelled with the failure's cause once triaged: a
  preemption, a maintenance or a planned swap is the infrastructure's and not counted, as in the
  stop rules). The stop rules already refuse a relaunch past that rate, but each refused run
  still triages and pages; when a job crashes in a loop the automation stops the runs
  themselves until a human resumes the deployment. With ``notify.block`` it also tells a person;
- with ``notify.block``, the approval notice tells the approver when a run of that deployment
  pauses for approval, with the run's UI link. It lives on the server, so it fires even when
  the paused run's own process is gone.
"""

from datetime import timedelta

from prefect.automations import Automation
from prefect.events.actions import PauseDeployment, SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.exceptions import ObjectNotFound

from tasks.errors import UsageError
from tasks.events import CAUSE_LABEL, RECOVERY_STARTED, flow_run_event, job_resource
from tasks.notify import block_id


def automation_name(job: str) -> str:
    return f"ckptops recovery storm {job}"


def approval_name(job: str) -> str:
    return f"ckptops recovery approval {job}"


def install(profile, deployment: str) -> list[Automation]:
    """Create (or replace: installing twice leaves one of each) the job's automations for
    ``deployment`` ("flow-name/deployment-name")."""
    from prefect import get_client

    if profile.recovery is None:
        raise UsageError(f"{profile.source}: no recovery section")
    job = profile.job.name
    block = block_id(profile)
    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise UsageError(f"deployment {deployment!r}: not found on the Prefect server") from None
        for name in (automation_name(job), approval_name(job)):
            for old in client.read_automations_by_name(name=name):
                client.delete_automation(old.id)
    made = [_storm_guard(profile, deployment, found.id, block)]
    if block is not None:
        made.append(_approval_notice(job, deployment, found.id, block))
    return made


def _storm_guard(profile, deployment: str, deployment_id, block) -> Automation:
    job, limit = profile.job.name, profile.recovery.max_per_hour
    actions = [PauseDeployment(source="selected", deployment_id=deployment_id)]
    if block is not None:
        actions.append(
            SendNotification(
                block_document_id=block,
                subject=f"ckptops {job}: failed more than {limit} times in an hour",
                body=f"[{job}] automatic recovery is paused ({deployment}): more than {limit} failures "
                "within an hour. Find the cause, then resume the deployment.",
            )
        )
    return Automation(
        name=automation_name(job),
        description=f"pause {deployment} after more than {limit} recoveries of {job}'s own failures "
        "within an hour",
        trigger=EventTrigger(
            match={"prefect.resource.id": job_resource(job), CAUSE_LABEL: "job"},
            expect={RECOVERY_STARTED},
            posture=Posture.Reactive,
            # More than max_per_hour failures: the one past the budget trips it.
            threshold=limit + 1,
            within=timedelta(hours=1),
        ),
        actions=actions,
    ).create()


def _approval_notice(job: str, deployment: str, deployment_id, block) -> Automation:
    return Automation(
        name=approval_name(job),
        description=f"tell the approver when a run of {deployment} waits for approval",
        trigger=EventTrigger(
            match={"prefect.resource.id": flow_run_event("*")},
            match_related={"prefect.resource.id": f"prefect.deployment.{deployment_id}"},
            expect={flow_run_event("Paused")},
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[
            SendNotification(
                block_document_id=block,
                subject=f"ckptops {job}: a recovery waits for your approval",
                body=f"[{job}] recovery run {{{{ flow_run.name }}}} waits for approval: the triage, the "
                "checkpoint and the node plan are on the form: {{ flow_run|ui_url }}",
            )
        ],
    ).create()
