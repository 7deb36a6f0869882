"""Runs that cannot wedge the pipeline, and the alarm when it wedges anyway.

A worker that dies while it submits a run (a host lost, ``make demo-down`` at the wrong moment)
leaves the run PENDING, holding its deployment's concurrency slot; one that dies while a run
executes leaves it RUNNING. With ``limit: 1, collision_strategy: ENQUEUE`` every later run of
that deployment then waits for the slot, so nothing is verified or promoted again (Prefect's own
lease on the slot lives in the server's memory: a server restart on the same database keeps the
slot taken for good). Three server automations, installed by ``ckptops automations``, keep that
from lasting:

- silent runs: a RUNNING run whose heartbeats (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, set for
  every deployment in infra/prefect.yaml) stop for ``MISSED_HEARTBEATS`` beats is crashed;
- stuck submissions: a run PENDING for ``prefect.submission_timeout_seconds`` without starting
  is crashed;
  (a crashed run gives its concurrency slot back, so the waiting runs go on);
- promotion overdue, per job, with ``notify.block``: a ``training.checkpoint.saved`` not followed
  by a ``ckptops.checkpoint.promoted`` for that job within ``verify.alert_after_seconds`` tells a
  person, whatever the cause.

Only runs tagged ``ckptops`` (every deployment of infra/prefect.yaml) are watched. The buckets of
these automations live in the server's database, so they outlast a server restart. And
``crash_orphans`` is the same cure applied at once, for a host that knows its worker is gone
(``make demo`` before it starts a new worker).
"""

from datetime import timedelta

from tasks.notify import block_id

TAG = "ckptops"
HEARTBEAT_SECONDS = 30  # infra/prefect.yaml sets PREFECT_FLOWS_HEARTBEAT_FREQUENCY to this
MISSED_HEARTBEATS = 3
PROMOTED_EVENT = "ckptops.checkpoint.promoted"
SAVED_EVENT = "training.checkpoint.saved"
SILENT = "ckptops crash silent runs"
STUCK = "ckptops crash stuck submissions"
_ENDED = ("Completed", "Failed", "Cancelled", "Crashed", "Cancelling", "Paused", "Scheduled")


def overdue_name(job: str) -> str:
    return f"ckptops promotion overdue {job}"


def _flow_run_events(*names: str) -> set[str]:
    return {f"prefect.flow-run.{name}" for name in names}


def _replace(client, automation):
    for old in client.read_automations_by_name(name=automation.name):
        client.delete_automation(old.id)
    return automation.create()


def install(profile, deployment: str | None = None) -> list:
    """Every automation the profile's job needs on its Prefect server: the watchdog's, and with
    ``deployment`` (the automatic recovery deployment) the recovery's (tasks.recovery.automation).
    Installing twice leaves one of each."""
    from tasks.checkpoint.catalog import catalog
    from tasks.checkpoint.overdue import alert_after
    from tasks.checkpoint.state import VerifyOptions
    from tasks.recovery import automation

    save_dir = profile.job.save_dir
    infos = catalog(save_dir, VerifyOptions.from_profile(profile)) if save_dir.is_dir() else []
    threshold, _ = alert_after(save_dir, infos, profile.verify.alert_after_seconds)
    made = watch(profile, threshold, block_id(profile))
    return made + (automation.install(profile, deployment) if deployment else [])


def watch(profile, alert_after_seconds: float, block_id=None) -> list:
    """Create (or replace) the two crash automations and, with a notification block, the job's
    promotion alarm."""
    from prefect import get_client
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState, SendNotification
    from prefect.events.schemas.automations import EventTrigger, Posture

    ours = {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{TAG}"}
    one_run = {"prefect.resource.id": "prefect.flow-run.*"}
    made = [
        Automation(
            name=SILENT,
            description=f"crash a ckptops run whose heartbeats stopped for {MISSED_HEARTBEATS} beats "
            "(its process died): its concurrency slot is given back",
            trigger=EventTrigger(
                match=one_run,
                match_related=ours,
                after={"prefect.flow-run.heartbeat"},
                expect={"prefect.flow-run.heartbeat", *_flow_run_events(*_ENDED)},
                for_each={"prefect.resource.id"},
                posture=Posture.Proactive,
                threshold=1,
                within=timedelta(seconds=HEARTBEAT_SECONDS * MISSED_HEARTBEATS),
            ),
            actions=[
                ChangeFlowRunState(
                    state=StateType.CRASHED,
                    message=f"no heartbeat for {HEARTBEAT_SECONDS * MISSED_HEARTBEATS} s: its process "
                    "is gone (ckptops watchdog)",
                )
            ],
        ),
        Automation(
            name=STUCK,
            description=f"crash a ckptops run pending for {profile.prefect.submission_timeout_seconds:.0f} s "
            "(its worker died while submitting it): its concurrency slot is given back",
            trigger=EventTrigger(
                match=one_run,
                match_related=ours,
                after={"prefect.flow-run.Pending"},
                expect=_flow_run_events("Running", *_ENDED),
                for_each={"prefect.resource.id"},
                posture=Posture.Proactive,
                threshold=1,
                within=timedelta(seconds=profile.prefect.submission_timeout_seconds),
            ),
            actions=[
                ChangeFlowRunState(
                    state=StateType.CRASHED,
                    message=f"pending for {profile.prefect.submission_timeout_seconds:.0f} s without "
                    "starting: its worker is gone (ckptops watchdog)",
                )
            ],
        ),
    ]
    job = profile.job.name
    if block_id is not None:
        made.append(
            Automation(
                name=overdue_name(job),
                description=f"tell a person when a save of {job} is not promoted within "
                f"{alert_after_seconds:.0f} s",
                trigger=EventTrigger(
                    match={"prefect.resource.id": f"ckptops.job.{job}"},
                    after={SAVED_EVENT},
                    expect={PROMOTED_EVENT},
                    for_each={"prefect.resource.id"},
                    posture=Posture.Proactive,
                    threshold=1,
                    within=timedelta(seconds=alert_after_seconds),
                ),
                actions=[
                    SendNotification(
                        block_document_id=block_id,
                        subject=f"ckptops {job}: a checkpoint was not promoted in time",
                        body=f"[{job}] a checkpoint was saved {alert_after_seconds:.0f} s ago and nothing "
                        "has been promoted since: is verify-and-promote running? `ckptops status` shows "
                        "the checkpoint; the Prefect UI shows the runs waiting for their deployment's slot.",
                    )
                ],
            )
        )
    with get_client(sync_client=True) as client:
        return [_replace(client, automation) for automation in made]


def announce_promotion(job: str, iteration: int) -> None:
    """The event the promotion alarm waits for: the pointer names ``iteration``, the newest
    complete checkpoint (emitted by verify-and-promote)."""
    from prefect.events import emit_event

    emit_event(
        event=PROMOTED_EVENT,
        resource={"prefect.resource.id": f"ckptops.job.{job}"},
        payload={"iteration": iteration},
    )


def crash_orphans(pool: str, why: str) -> list[str]:
    """Crash every PENDING or RUNNING run of work pool ``pool`` (the caller knows no worker of
    the pool runs them any more), which gives their concurrency slots back; their names."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        found = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING])
                )
            ),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
        )
        for run in found:
            client.set_flow_run_state(run.id, Crashed(message=why), force=True)
    return [run.name for run in found]
