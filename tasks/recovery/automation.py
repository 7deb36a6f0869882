"""The failure-storm guard: a Prefect automation that pauses a job's automatic recovery
deployment when the job fails more than ``recovery.max_per_hour`` times within an hour.

The stop rules already refuse a relaunch past that rate, but each refused run still triages and
pages. When a job crashes in a loop, the automation stops the runs themselves until a human
resumes the deployment. It lives on the server (it keeps working while no flow runs), so it is
installed once per job: ``ckptops recovery-guard``.
"""

from datetime import timedelta

from prefect.automations import Automation
from prefect.events.actions import PauseDeployment, SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.exceptions import ObjectNotFound

from tasks.errors import UsageError

FAILED_EVENT = "training.job.failed"


def automation_name(job: str) -> str:
    return f"ckptops recovery storm {job}"


def install_storm_guard(profile, deployment: str, notify_block_id=None) -> Automation:
    """Create (or replace) the job's guard for ``deployment`` ("flow-name/deployment-name")."""
    from prefect import get_client

    if profile.recovery is None:
        raise UsageError(f"{profile.source}: no recovery section")
    job = profile.job.name
    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise UsageError(f"deployment {deployment!r}: not found on the Prefect server") from None
        # Replaced, never duplicated: installing twice leaves one guard.
        for old in client.read_automations_by_name(name=automation_name(job)):
            client.delete_automation(old.id)
    actions = [PauseDeployment(source="selected", deployment_id=found.id)]
    if notify_block_id is not None:
        actions.append(
            SendNotification(
                block_document_id=notify_block_id,
                subject=f"ckptops: {job} failed more than {profile.recovery.max_per_hour} times in an hour",
                body=f"Automatic recovery of {job} is paused ({deployment}); resume it once the cause "
                "is fixed.",
            )
        )
    return Automation(
        name=automation_name(job),
        description=f"pause {deployment} after more than {profile.recovery.max_per_hour} failures of "
        f"{job} within an hour",
        trigger=EventTrigger(
            match={"prefect.resource.id": f"ckptops.job.{job}"},
            expect={FAILED_EVENT},
            posture=Posture.Reactive,
            # More than max_per_hour failures: the one past the budget trips it.
            threshold=profile.recovery.max_per_hour + 1,
            within=timedelta(hours=1),
        ),
        actions=actions,
    ).create()
