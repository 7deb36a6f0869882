"""recovery-run: from a failed training job to a validated resume, or to a human.

Triggered by a ``training.job.failed`` event (a job's epilog posts it), from the UI's Run button,
or by ``ckptops recover``. Triage, stop rules, checkpoint choice, node health with drains and
spares, approval (auto for the profile's classes, else a form on the paused run), relaunch,
progress, post-resume validation; the incident goes to the job's ledger and the UI.
"""

from pathlib import Path
from typing import Literal

from prefect import flow
from prefect.runtime import flow_run
from prefect.states import Cancelled, Completed, Failed

from tasks.notify import send
from tasks.profile import load_profile
from tasks.recovery.flow_tasks import announce, ask_in_ui, flow_step, publish_incident
from tasks.recovery.ledger import IncidentOutcome
from tasks.recovery.run import Duplicate, Source, recover


@flow(name="recovery-run", log_prints=True)
def recovery_run(
    profile: str = "local",
    slurm_job: str | None = None,
    logs: list[str] | None = None,
    exit_code: int | None = None,
    mode: Literal["auto", "ask"] = "auto",
    trigger: str = "manual",
    retry: bool = False,
):
    """``slurm_job`` or ``logs`` name what failed. ``mode``: ``auto`` relaunches the profile's
    auto-approved classes without asking; ``ask`` always waits for an approver. ``retry``:
    recover a failure again whose earlier recovery relaunched nothing (an approver said no)."""
    prof = load_profile(profile)
    if mode == "ask" and prof.recovery is not None:
        prof = prof.model_copy(update={"recovery": prof.recovery.model_copy(update={"auto_approve": []})})
    source = Source(slurm_job or None, [Path(p) for p in logs or []], exit_code)
    timeout = prof.recovery.approval_timeout_seconds if prof.recovery else 0
    try:
        incident = recover(
            prof,
            source,
            trigger,
            ask_in_ui(timeout),
            step=flow_step,
            flow_run=str(flow_run.id),
            started=lambda i: announce(prof.job.name, i, {"slurm_job": slurm_job, "logs": logs or []}),
            warn=print,
            retry=retry,
        )
    except Duplicate as e:
        # Another run has this failure in hand: nothing to do, nobody to page. One that has
        # handled it already is news for a person (a failure may have been taken for another).
        print(e)
        unsent = None if e.incident.running else send(prof, "recovery refused: a duplicate", str(e))
        return Cancelled(message=str(e) + (f"; {unsent}" if unsent else ""))
    publish_incident(prof.job.save_dir, incident)
    message = f"{incident.id} {incident.cls}: {incident.outcome}: {incident.reason}"
    print(message)
    if incident.outcome == IncidentOutcome.COMPLETED:
        return Completed(message=message)
    unsent = send(prof, f"recovery {incident.outcome}", message)
    return Failed(message=message + (f"; {unsent}" if unsent else ""))
