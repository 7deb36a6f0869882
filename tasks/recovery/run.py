"""A recovery run: from a failed training job to a validated resume, or to a human.

The one composition of a recovery, which the flow (flows/recovery_run.py) and the CLI
(``ckptops recover``) both run. They differ only in how a human approves (a paused flow run
with a form, or a terminal prompt) and in how phases are shown (tasks in the UI, lines on a
terminal): ``approve`` and ``step`` are passed in.

Phases: detect (what failed, where), triage, stop rules, checkpoint, nodes (health, drain,
exclude, spares), approval, relaunch, progress, validation; every phase's time and every fact
land in the incident, which is appended to the ledger however the run ends.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tasks.checkpoint import layout
from tasks.checkpoint.catalog import catalog
from tasks.checkpoint.manifest import valid_for_this_save
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.promote import promote
from tasks.checkpoint.state import State, VerifyOptions
from tasks.cluster import slurm
from tasks.errors import CkptopsError, UsageError
from tasks.health.actions import apply_drains, plan_drains, spare_readiness
from tasks.health.run import run_health
from tasks.recovery import job as jobs
from tasks.recovery.ledger import (
    ABORTED,
    COMPLETED,
    STOPPED,
    WARNED,
    Incident,
    incidents,
    lost_gpu_hours,
    new_id,
    record,
)
from tasks.recovery.rules import Failure, Rule, fired, stop_rules
from tasks.recovery.triage import Triage, triage
from tasks.resume.records import Steps, load_steps
from tasks.resume.validate import checkpoint_facts, validate_resume


@dataclass
class Source:
    """What failed: a Slurm job (its output files are read), log files, or both."""

    slurm_job: str | None = None
    logs: list[Path] = field(default_factory=list)
    exit_code: int | None = None


@dataclass
class Plan:
    """What the approver decides on."""

    incident: Incident
    triage: Triage
    rules: list[Rule]
    checkpoint: int | None
    choices: list[int]  # other verified checkpoints the approver may pick instead
    drained: list[str]
    exclude: list[str]
    admitted: list[str]
    relaunch: str  # the command that will run, for the record


@dataclass
class Decision:
    approve: bool
    by: str
    checkpoint: int | None = None  # another checkpoint than the plan's
    note: str = ""


# sinfo's short states of a node that is out of service (drained, draining, down).
_HELD_STATES = ("drain", "drng", "down")


def plain_step(name: str, fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


def _records(profile) -> Path | None:
    return profile.recovery.step_records if profile.recovery else None


def _steps(records: Path | None):
    if records is None:
        return None
    try:
        return load_steps(records)
    except UsageError:
        return None


@dataclass
class Detected:
    """What is known of the failed job before reading its logs."""

    logs: list[Path]
    layout: dict[int, str]  # rank -> node
    exit_code: int | None
    nodes: list[str]
    partition: str | None


def detect(profile, source: Source) -> Detected:
    """The logs to read, the rank -> node layout, the exit code, the job's nodes and partition."""
    found = Detected(list(source.logs), {}, source.exit_code, [], None)
    if source.slurm_job:
        job = jobs.slurm_job(source.slurm_job)
        found.layout, found.nodes, found.partition = job.layout(), job.nodes, job.partition
        if found.exit_code is None:
            found.exit_code = job.exit_code
        for path in (job.stdout, job.stderr):
            if path is not None and path not in found.logs and path.exists():
                found.logs.append(path)
    if not found.logs:
        raise UsageError("no logs to triage: name a Slurm job whose output still exists, or log files")
    return found


def promote_pending(profile) -> tuple[int | None, str]:
    """Verify the complete checkpoints nobody verified yet (the job may have died right after a
    save) and promote as verify-and-promote would; the promoted iteration and a note."""
    try:
        report = promote(
            profile.job.save_dir, VerifyOptions.from_profile(profile), profile.verify.lock_timeout_seconds
        )
    except CkptopsError as e:
        return read_pointer(profile.job.save_dir), f"promotion before choosing failed: {e}"
    return report.current, report.summary()


def choose_checkpoint(
    profile, failure_iteration: int | None, before: int | None
) -> tuple[int | None, list[int]]:
    """The newest verified checkpoint at or before the failure (and before ``before``, the start
    of a numerical anomaly). Never Megatron's tracker: the promotion pointer and the manifests
    decide. Returns it and every candidate, newest first."""
    save_dir = profile.job.save_dir
    options = VerifyOptions.from_profile(profile)
    candidates = []
    for info in catalog(save_dir, options):
        if info.state is not State.VALID or info.stale:
            continue
        if failure_iteration is not None and info.iteration > failure_iteration:
            continue
        if before is not None and info.iteration >= before:
            continue
        if valid_for_this_save(save_dir / layout.iter_dir_name(info.iteration), info.iteration) is None:
            continue
        candidates.append(info.iteration)
    if not candidates:
        return None, []
    pointer = read_pointer(save_dir)
    chosen = pointer if pointer in candidates else max(candidates)
    return chosen, sorted(candidates, reverse=True)


def nodes_phase(profile, incident: Incident, suspects: list[str], job_nodes: list[str]):
    """Health-check the suspects; drain the confirmed bad (reason names the incident), exclude
    the rest of the suspects; admit spares to give the job its node count back."""
    health = profile.health
    if job_nodes:
        suspects = [n for n in suspects if n in job_nodes] or suspects
    drained, exclude, admitted = [], list(suspects), []
    if not (health and suspects):
        return drained, exclude, admitted, "no health checks (no suspects or no health section)"
    run = run_health(health, suspects)
    bad = [r for r in run.reports if r.verdict.failed]
    plan = plan_drains(bad, health, reason=f"ckptops {incident.id} {incident.cls}")
    apply_drains(plan, health)
    drained = list(plan.drained)
    note = "; ".join(f"{r.node} {r.verdict.value}: {r.summary}" for r in run.reports)
    if plan.page:
        note += f"; PAGE: {plan.page}"
    removed = len({*drained, *exclude})
    if health.spares and removed and job_nodes:
        admitted = _admit_spares(health, removed, exclude + drained)
        if admitted:
            note += f"; spares admitted: {', '.join(admitted)}"
    return drained, exclude, admitted, note


def _admit_spares(health, wanted: int, avoid: list[str]) -> list[str]:
    """Run the admission set on spares held out of service (drained or down) and resume the
    ready ones in Slurm. A spare that is already in service needs no admitting."""
    held = [s for s in health.spares if s not in avoid and slurm.node_state(s) in _HELD_STATES]
    candidates = held[:wanted]
    if not candidates:
        return []
    run = run_health(health, candidates, admit=True)
    ready = [
        node
        for node, verdict in spare_readiness(run.reports, candidates, run.level).items()
        if verdict == "ready"
    ]
    for node in ready:
        slurm.resume(node)
    return ready


def _failed_attempt(steps: Steps | None, slurm_job: str | None) -> Steps | None:
    """The failed attempt's records: its rows (a Slurm job's attempt id is its job id), else the
    last attempt's; None without records."""
    if steps is None or not len(steps):
        return None
    if steps.attempt.size != len(steps):
        return steps  # a log: no attempt ids
    ours = steps.attempt == str(slurm_job) if slurm_job else np.zeros(len(steps), dtype=bool)
    return steps.take(np.nonzero(ours if ours.any() else steps.attempt == steps.attempt[-1])[0])


def _anomaly(tri: Triage, steps) -> int | None:
    if tri.anomaly_iteration is not None:
        return tri.anomaly_iteration
    if steps is not None and "nonfinite" in steps.columns:
        bad = np.nonzero(steps.columns["nonfinite"] > 0)[0]
        if bad.size:
            return int(steps.iteration[bad[0]])
    return tri.iteration


def recover(
    profile,
    source: Source,
    trigger: str,
    approve: Callable[[Plan], Decision],
    step: Callable = plain_step,
    flow_run: str | None = None,
    started: Callable[[Incident], None] | None = None,
) -> Incident:
    """Run one recovery; the incident is in the ledger when this returns (or raises).
    ``started`` is told the incident as soon as it exists (the flow emits an event)."""
    settings = profile.recovery
    if settings is None:
        raise UsageError(f"{profile.source}: no recovery section")
    incident = Incident(new_id(), profile.job.name, trigger, source.slurm_job, flow_run=flow_run)
    incident.mark("detected")
    if started:
        started(incident)
    try:
        _run(profile, source, incident, approve, step)
    except CkptopsError as e:
        incident.outcome, incident.reason = STOPPED, str(e)
    finally:
        if incident.outcome is None:
            incident.outcome, incident.reason = STOPPED, "the recovery run ended unexpectedly"
        record(profile.job.save_dir, incident)
    return incident


def _stop(incident: Incident, reason: str, outcome: str = STOPPED) -> None:
    incident.outcome, incident.reason = outcome, reason


def _run(profile, source: Source, incident: Incident, approve, step) -> None:
    settings = profile.recovery
    save_dir = profile.job.save_dir
    detected: Detected = step("detect", detect, profile, source)
    job_nodes = detected.nodes
    tri: Triage = step(
        "triage",
        triage,
        detected.logs,
        detected.layout or None,
        detected.exit_code,
        profile.health.critical_xids if profile.health else None,
    )
    incident.mark("triaged")
    records = _records(profile)
    steps = _steps(records)
    incident.cls, incident.exit_code = tri.cls, tri.exit_code
    incident.first_error = tri.to_dict()["first_error"]
    incident.suspect_nodes = list(tri.suspect_nodes)
    if tri.first_error is not None and tri.first_error.at is not None:
        incident.mark("first_error", tri.first_error.at)
    failed = _failed_attempt(steps, source.slurm_job)
    if failed is not None:
        incident.failure_iteration = int(failed.iteration[-1])
        if np.isfinite(failed.time[-1]):
            incident.mark("last_progress", float(failed.time[-1]))
    else:
        incident.failure_iteration = tri.iteration
    incident.promoted_at_failure, promotion = step("promote-pending", promote_pending, profile)
    incident.gpus = settings.gpus or profile.job.layout.world_size

    failure = Failure(
        tri.cls, incident.failure_iteration, tri.exit_code, incident.promoted_at_failure, time.time()
    )
    history = [i for i in incidents(save_dir) if i.job == profile.job.name]
    rules = step("stop-rules", stop_rules, failure, history, settings.max_per_hour)
    incident.rules = [r.to_dict() for r in rules]
    if fired(rules):
        # A human decides from here: nothing is drained, chosen or relaunched.
        _stop(incident, "stop rule: " + "; ".join(f"{r.name}: {r.detail}" for r in fired(rules)))
        incident.stop_rule = fired(rules)[0].name
        return

    before = _anomaly(tri, steps) if tri.cls == "numerics" else None
    chosen, choices = step(
        "choose-checkpoint", choose_checkpoint, profile, incident.failure_iteration, before
    )
    drained, exclude, admitted, health_note = step(
        "nodes", nodes_phase, profile, incident, incident.suspect_nodes, job_nodes
    )
    incident.health = health_note
    incident.drained, incident.excluded, incident.admitted = drained, exclude, admitted
    incident.mark("health_done")
    needed = settings.nodes or len(job_nodes)
    if settings.launcher == "slurm" and detected.partition and needed:
        # A relaunch needing more nodes than are in service would wait in the queue forever.
        usable = step("capacity", slurm.usable_nodes, detected.partition, exclude)
        if len(usable) < needed:
            _stop(
                incident,
                f"the job needs {needed} nodes; partition {detected.partition} has {len(usable)} in "
                f"service outside the excluded {', '.join(exclude) or 'none'}",
            )
            return

    if chosen is None:
        _stop(incident, f"no verified checkpoint to resume from ({promotion})")
        return
    job_name = settings.job_name or profile.job.name
    log_dir = settings.log_dir or save_dir.parent / "logs"
    relaunch = (
        " ".join(jobs.sbatch_command(settings, job_name, chosen, exclude, log_dir))
        if settings.launcher == "slurm"
        else f"bash {settings.script}"
    )
    plan = Plan(incident, tri, rules, chosen, choices, drained, exclude, admitted, relaunch)

    incident.mark("approval_requested")
    if tri.cls in settings.auto_approve:
        decision = Decision(True, f"auto: {tri.cls} is in recovery.auto_approve")
    else:
        decision = approve(plan)
    if not decision.approve:
        _stop(
            incident, f"not approved ({decision.by}){': ' + decision.note if decision.note else ''}", ABORTED
        )
        return
    incident.mark("approved")
    if decision.checkpoint is not None and decision.checkpoint != chosen:
        if decision.checkpoint not in choices:
            _stop(incident, f"checkpoint {decision.checkpoint} is not a verified candidate ({choices})")
            return
        chosen = decision.checkpoint
    incident.checkpoint = chosen
    if read_pointer(save_dir) != chosen:
        # A rollback (numerics, or the approver's pick) goes through the pointer, with a hold,
        # as an operator's would: the pointer stays the one record of what the job resumed from.
        step("roll-back-pointer", _roll_back, profile, chosen)

    # The job is down: the records read at triage are all there are until the relaunch writes.
    before_rows = len(steps) if steps is not None else 0
    if settings.launcher == "slurm":
        new = step("relaunch", jobs.submit, settings, job_name, chosen, exclude, log_dir)
    else:
        new = step("relaunch", jobs.start_local, settings, chosen, log_dir)
    incident.relaunched_job = new
    incident.mark("relaunch_submitted")
    state = step("wait-running", jobs.wait_running, new, settings.progress_timeout_seconds)
    incident.mark("job_running")
    if records is None:
        _stop(
            incident,
            f"relaunched ({new}, {state}); no recovery.step_records to watch its progress or validate",
        )
        return
    progress = step(
        "wait-progress",
        jobs.wait_progress,
        new,
        records,
        before_rows,
        settings.progress_steps,
        settings.progress_timeout_seconds,
    )
    incident.mark("first_resumed_step", progress.first_step_at)
    checkpoint_dir = save_dir / layout.iter_dir_name(chosen)
    now = load_steps(records)
    resumed = now.take(np.arange(before_rows, len(now)))
    result = step("validate-resume", validate_resume, checkpoint_dir, failed, resumed, profile.resume)
    incident.mark("validated")
    incident.validation = result.line()
    _account(incident, failed, checkpoint_dir)
    if result.ok:
        _stop(incident, f"resumed from {chosen} as {new}; {result.line()}", COMPLETED)
    elif settings.on_rejected == "warn":
        _stop(
            incident,
            f"resume rejected, job left running (recovery.on_rejected: warn): {result.line()}",
            WARNED,
        )
    else:
        jobs.cancel(new)
        _stop(incident, f"resume rejected, job {new} cancelled: {result.line()}")


def _roll_back(profile, iteration: int) -> None:
    promote(
        profile.job.save_dir,
        VerifyOptions.from_profile(profile),
        profile.verify.lock_timeout_seconds,
        requested=iteration,
    )


def _account(incident: Incident, steps, checkpoint_dir: Path) -> None:
    """Recomputed work and lost GPU-hours, from the records before the failure."""
    if incident.failure_iteration is None or incident.checkpoint is None:
        return
    recomputed = max(0, incident.failure_iteration - incident.checkpoint)
    incident.recomputed_iterations = recomputed
    facts = checkpoint_facts(checkpoint_dir)
    per_step = facts.global_batch_size * (facts.seq_length or 0)
    incident.recomputed_tokens = recomputed * per_step if per_step else None
    step_seconds = 0.0
    if steps is not None and "step_seconds" in steps.columns:
        finite = steps.columns["step_seconds"][np.isfinite(steps.columns["step_seconds"])]
        step_seconds = float(np.median(finite)) if finite.size else 0.0
    t = incident.times
    start = t.get("first_error") or t.get("last_progress") or t.get("detected")
    downtime = (t.get("first_resumed_step") or time.time()) - start
    incident.lost_gpu_hours = round(lost_gpu_hours(incident.gpus or 0, downtime, recomputed, step_seconds), 4)
