"""Runs that cannot wedge the pipeline, and the alarm when it wedges anyway.

A worker that dies while it submits a run (a host lost, ``make demo-down`` at the wrong moment)
leaves the run PENDING, holding its deployment's concurrency slot; one that dies while a run
executes leaves it RUNNING. With ``limit: 1, collision_strategy: ENQUEUE`` every later run of
that deployment then waits for the slot, so nothing is verified or promoted again (Prefect's own
lease on the slot lives in the server's memory: a server restart on the same database keeps the
slot taken for good). Server automations, installed by ``ckptops automations``, keep that from
lasting:

- silent runs: a RUNNING run whose heartbeats (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, set for
  every deployment in infra/prefect.yaml) stop for ``prefect.silent_run_seconds`` is crashed;
- stuck submissions: a run PENDING for ``prefect.submission_timeout_seconds`` without starting
  is crashed; a crashed run gives its concurrency slot back, so the waiting runs go on;
- promotion overdue, per job, with ``notify.block``: a ``training.checkpoint.saved`` not followed
  by a ``ckptops.checkpoint.promoted`` for that job within ``verify.alert_after_seconds`` tells a
  person, whatever the cause. Its threshold follows the saves (``refresh_alarm``), and
  verify-and-promote tells it of each promotion that caught up (``announce_if_caught_up``).

Only runs tagged ``ckptops`` (every deployment of infra/prefect.yaml) are watched. The buckets of
these automations live in the server's database, so they outlast a server restart. And
``crash_orphans`` is the same cure applied at once, for a host that knows its worker is gone
(``make demo`` before it starts a new worker).
"""

from datetime import timedelta

from prefect import get_client, task
from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState, SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture

from tasks.events import CHECKPOINT_PROMOTED, CHECKPOINT_SAVED, flow_run_event, job_resource
from tasks.notify import block_id

TAG = "ckptops"
HEARTBEAT_SECONDS = 30  # infra/prefect.yaml sets PREFECT_FLOWS_HEARTBEAT_FREQUENCY to this
SILENT = "ckptops crash silent runs"
STUCK = "ckptops crash stuck submissions"
_ENDED = ("Completed", "Failed", "Cancelled", "Crashed", "Cancelling", "Paused", "Scheduled")
# A proactive trigger's window may be no shorter (Prefect refuses it).
MIN_WINDOW_SECONDS = 10
# The alarm is installed anew when the saves' interval moves it by more than this.
_ALARM_DRIFT = 0.1


def overdue_name(job: str) -> str:
    return f"ckptops promotion overdue {job}"


def _flow_run_events(*names: str) -> set[str]:
    return {flow_run_event(name) for name in names}


def _crash(
    name: str, description: str, after: set[str], expect: set[str], seconds: float, why: str
) -> Automation:
    """Crash a ckptops flow run that saw one of ``after`` and then none of ``expect`` for
    ``seconds``."""
    return Automation(
        name=name,
        description=description,
        trigger=EventTrigger(
            match={"prefect.resource.id": flow_run_event("*")},
            match_related={"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{TAG}"},
            after=after,
            expect=expect,
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=seconds),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=f"{why} (ckptops watchdog)")],
    )


def crash_automations(settings) -> list[Automation]:
    """The two crash automations, from the profile's ``prefect`` section."""
    silent, pending = settings.silent_run_seconds, settings.submission_timeout_seconds
    return [
        _crash(
            SILENT,
            f"crash a ckptops run whose heartbeats stopped for {silent:.0f} s (its process died): its "
            "concurrency slot is given back",
            # From its start: a process that dies before its first beat is silent too.
            _flow_run_events("heartbeat", "Running"),
            _flow_run_events("heartbeat", *_ENDED),
            silent,
            f"no heartbeat for {silent:.0f} s: its process is gone",
        ),
        _crash(
            STUCK,
            f"crash a ckptops run pending for {pending:.0f} s (its worker died while submitting it): its "
            "concurrency slot is given back",
            _flow_run_events("Pending"),
            _flow_run_events("Running", *_ENDED),
            pending,
            f"pending for {pending:.0f} s without starting: its worker is gone",
        ),
    ]


def alarm(job: str, seconds: float, block) -> Automation:
    """The promotion alarm of ``job``: a save not followed by a promotion within ``seconds``."""
    return Automation(
        name=overdue_name(job),
        description=f"tell a person when a save of {job} is not promoted within {seconds:.0f} s",
        trigger=EventTrigger(
            match={"prefect.resource.id": job_resource(job)},
            after={CHECKPOINT_SAVED},
            expect={CHECKPOINT_PROMOTED},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=max(MIN_WINDOW_SECONDS, seconds)),
        ),
        actions=[
            SendNotification(
                block_document_id=block,
                subject=f"ckptops {job}: a checkpoint was not promoted in time",
                body=f"[{job}] a checkpoint was saved {seconds:.0f} s ago and nothing has been promoted "
                "since: is verify-and-promote running? `ckptops status` shows the checkpoint; the Prefect "
                "UI shows the runs waiting for their deployment's slot.",
            )
        ],
    )


def _alert_after(profile, infos=None) -> float:
    from tasks.checkpoint.catalog import catalog
    from tasks.checkpoint.overdue import alert_after
    from tasks.checkpoint.state import VerifyOptions

    save_dir = profile.job.save_dir
    if infos is None:
        infos = catalog(save_dir, VerifyOptions.from_profile(profile)) if save_dir.is_dir() else []
    return alert_after(save_dir, infos, profile.verify.alert_after_seconds)[0]


def _replace(client, automation: Automation) -> Automation:
    for old in client.read_automations_by_name(name=automation.name):
        client.delete_automation(old.id)
    return automation.create()


def install(profile, deployment: str | None = None) -> list[Automation]:
    """Every automation the profile's job needs on its Prefect server: the two crash
    automations, with ``notify.block`` the promotion alarm, and with ``deployment`` (the
    automatic recovery deployment) the recovery's (tasks.recovery.automation). Installing twice
    leaves one of each."""
    from tasks.recovery import automation

    made = crash_automations(profile.prefect)
    block = block_id(profile)
    if block is not None:
        made.append(alarm(profile.job.name, _alert_after(profile), block))
    with get_client(sync_client=True) as client:
        made = [_replace(client, each) for each in made]
    return made + (automation.install(profile, deployment) if deployment else [])


def refresh_alarm(profile, infos) -> Automation | None:
    """Keep the installed promotion alarm's threshold what the saves show now (installed before
    the job had saved twice, its default was a guess); the new alarm, if it had to change."""
    threshold = max(MIN_WINDOW_SECONDS, _alert_after(profile, infos))
    with get_client(sync_client=True) as client:
        for installed in client.read_automations_by_name(name=overdue_name(profile.job.name)):
            current = installed.trigger.within.total_seconds()
            if abs(current - threshold) > _ALARM_DRIFT * threshold:
                return _replace(
                    client, alarm(profile.job.name, threshold, installed.actions[0].block_document_id)
                )
    return None


def announce_promotion(job: str, iteration: int) -> None:
    """The event the promotion alarm waits for: the pointer names ``iteration``, the newest
    complete checkpoint (emitted by verify-and-promote)."""
    from prefect.events import emit_event

    emit_event(
        event=CHECKPOINT_PROMOTED,
        resource={"prefect.resource.id": job_resource(job)},
        payload={"iteration": iteration},
    )


@task(name="announce-promotion")
def announce_if_caught_up(profile, options) -> bool:
    """Tell the promotion alarm when the pointer names the newest complete checkpoint, and keep
    its threshold what the saves show (``options``: the job's verify options); whether it does."""
    from tasks.checkpoint.catalog import catalog
    from tasks.checkpoint.overdue import caught_up

    infos = catalog(profile.job.save_dir, options)
    refresh_alarm(profile, infos)
    if not caught_up(infos):
        return False
    promoted = next(i.iteration for i in infos if i.promoted)
    announce_promotion(profile.job.name, promoted)
    return True


def crash_orphans(pool: str, why: str) -> list[str]:
    """Crash every PENDING or RUNNING run of work pool ``pool`` (the caller knows no worker of
    the pool runs them any more), which gives their concurrency slots back; their names."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
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
