"""The phases of a recovery, each a function of the profile and what the phases before found:
what failed (detect, its key), the checkpoint (pending promotions, the choice, its re-verification),
the nodes (health, drains, spares), the failed attempt's records, and the accounting at the end.
The composition and its safety (one recovery per job, the incident in the ledger from the start)
are tasks.recovery.run.
"""

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tasks.checkpoint import layout
from tasks.checkpoint.catalog import catalog, resumable
from tasks.checkpoint.facts import checkpoint_facts
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.promote import promote, reverify
from tasks.checkpoint.signing import Trust
from tasks.checkpoint.state import VerifyOptions
from tasks.cluster import slurm
from tasks.errors import CkptopsError, Unreadable, UsageError
from tasks.health import fleet
from tasks.health.accounting import fleet as fleet_places
from tasks.health.actions import DRAIN_LOG, Readiness
from tasks.health.run import run_health
from tasks.health.sweep import HELD_STATES, sweep
from tasks.health.verdict import CheckName
from tasks.job.step_records import Steps, load_steps, read_configured
from tasks.outcome import Verdict
from tasks.recovery import job as jobs
from tasks.recovery.infrastructure import taken_away
from tasks.recovery.ledger import Incident, lost_gpu_hours
from tasks.recovery.triage import Triage
from tasks.relaunch.fit import Compatibility, checkpoint_fit
from tasks.relaunch.launch import Launch
from tasks.relaunch.precheck import check_script
from tasks.restore.history import drilled_layouts


@dataclass
class Source:
    """What failed: a Slurm job (its output files are read), log files, or both."""

    slurm_job: str | None = None
    logs: list[Path] = field(default_factory=list)
    exit_code: int | None = None


@dataclass
class Detected:
    """What is known of the failed job before reading its logs."""

    logs: list[Path]
    layout: dict[int, str]  # rank -> node
    exit_code: int | None
    nodes: list[str]
    partition: str | None
    attempt: str | None = None  # the Slurm job's start: its requeues and start time
    infrastructure: str | None = None  # Slurm says the infrastructure ended it (infrastructure.py)


def detect(profile, source: Source) -> Detected:
    """The logs to read, the rank -> node layout, the exit code, the job's nodes and partition."""
    found = Detected(list(source.logs), {}, source.exit_code, [], None)
    if source.slurm_job:
        job = jobs.slurm_job(source.slurm_job)
        found.layout, found.nodes, found.partition = job.layout(), job.nodes, job.partition
        found.attempt = f"{job.restarts}:{job.start_time}"
        drains = Path(profile.health.raw_dir) / DRAIN_LOG if profile.health is not None else None
        found.infrastructure = taken_away(job, drains)
        if found.exit_code is None:
            found.exit_code = job.exit_code
        for path in (job.stdout, job.stderr):
            if path is not None and path not in found.logs and path.exists():
                found.logs.append(path)
    if not found.logs:
        raise UsageError("no logs to triage: name a Slurm job whose output still exists, or log files")
    return found


def failure_key(source: Source, tri: Triage, detected: Detected | None = None) -> str:
    """One failure's identity. A Slurm job's id and its start (a requeued job fails again as
    another attempt); else its logs' first error (file, line and text) and the logs' sizes (a
    log appended to by a later run that fails the same way is another failure)."""
    if source.slurm_job:
        return f"slurm:{source.slurm_job}:{detected.attempt if detected else ''}"
    digest = hashlib.sha256()
    first = tri.first_error
    if first is not None:
        digest.update(f"{Path(first.file).resolve()}\0{first.line}\0{first.text}\0".encode())
    for path in sorted(Path(p).resolve() for p in source.logs):
        digest.update(f"{path}\0{path.stat().st_size}\0".encode())
    return f"logs:{digest.hexdigest()[:16]}"


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
    profile, failure_iteration: int | None, before: int | None, passed_over: tuple[int, ...] = ()
) -> tuple[int | None, list[int]]:
    """The newest resumable checkpoint at or before the failure (and before ``before``, the
    start of a numerical anomaly), not one of ``passed_over``. Never Megatron's tracker: the
    promotion pointer and the manifests decide. Returns it and every candidate, newest first."""
    save_dir = profile.job.save_dir
    candidates = [
        info.iteration
        for info in resumable(catalog(save_dir, VerifyOptions.from_profile(profile)))
        if info.iteration not in passed_over
        and (failure_iteration is None or info.iteration <= failure_iteration)
        and (before is None or info.iteration < before)
    ]
    if not candidates:
        return None, []
    pointer = read_pointer(save_dir)
    return (pointer if pointer in candidates else candidates[0]), candidates


def certifications(profile, iterations: list[int]) -> dict[int, bool | None]:
    """Each candidate's continuation drill, as its manifest records it: True certified (it went
    on as the original run did), False it loads but does not resume, None never continued."""
    infos = catalog(profile.job.save_dir, VerifyOptions.from_profile(profile))
    found = {i.iteration: i.certified for i in infos}
    return {iteration: found.get(iteration) for iteration in iterations}


def relaunch_compatibility(profile, iteration: int, versions: dict | None = None) -> Compatibility:
    """The relaunch script's Megatron-LM flags against what checkpoint ``iteration`` saved, in
    the environment the relaunch inherits (tasks.relaunch.fit), a resharding allowed onto the
    layouts the job's drills loaded; ``versions``: the relaunch environment's, when an earlier
    comparison has asked them."""
    check_script(profile.recovery.script)  # before any node is touched, as at the submission
    launch = Launch(profile.recovery.script, iteration, profile.recovery.pass_step)
    directory = Path(profile.job.save_dir) / layout.iter_dir_name(iteration)
    drilled = drilled_layouts(profile.job.save_dir)
    return checkpoint_fit(profile, directory, launch.script, launch.environ(), drilled, versions)


def unusable(profile) -> str:
    """Why no checkpoint can be resumed from: each one and its one-line state."""
    infos = catalog(profile.job.save_dir, VerifyOptions.from_profile(profile))
    if not infos:
        return f"{profile.job.save_dir} holds no checkpoint"
    return "; ".join(f"{layout.iter_dir_name(i.iteration)} {i.state}: {i.reason}" for i in reversed(infos))


def reverify_checkpoint(profile, iteration: int) -> dict:
    """Verify the chosen checkpoint again before it is relaunched from (every byte with the
    profile's engine, or its manifest's save identity with ``recovery.reverify: manifest``); a
    failure marks it invalid and moves the pointer as promotion would. What was found."""
    mode = profile.recovery.reverify
    started = time.monotonic()
    result, report = reverify(
        profile.job.save_dir,
        VerifyOptions.from_profile(profile),
        iteration,
        profile.verify.lock_timeout_seconds,
        full=mode == "full",
    )
    return {
        "iteration": iteration,
        "mode": mode,
        "engine": profile.verify.engine if mode == "full" else None,
        "outcome": "pass" if result.ok else "fail",
        "state": str(result.state),
        "reason": result.reason,
        "seconds": round(time.monotonic() - started, 3),
        "bytes": result.bytes_read,
        "pointer": report.current,
    }


def nodes_phase(profile, incident: Incident, suspects: list[str], job_nodes: list[str]):
    """Health-check the suspects; drain the confirmed bad (reason names the incident), exclude
    the rest of the suspects; check the job's other nodes for GPUs a dead process still holds
    (``held_gpus``: excluded, not drained); admit spares held out of service to give the job its
    node count back (the same sweep as node health's, tasks.health.sweep)."""
    health = profile.health
    if job_nodes:
        suspects = [n for n in suspects if n in job_nodes] or suspects
    if health is None:
        return [], list(suspects), [], "no health checks (no health section)"
    notes, drained = [], []
    if suspects:
        reason = f"ckptops {incident.id} {incident.cls}" + (
            f" GPU {', '.join(incident.suspect_gpus)}" if incident.suspect_gpus else ""
        )
        checked = sweep(health, suspects, reason=reason, incident=incident.id)
        drained = list(checked.plan.drained)
        notes += [f"{r.node} {r.verdict.value}: {r.summary}" for r in checked.run.reports]
        if checked.plan.page:
            notes.append(f"PAGE: {checked.plan.page}")
    else:
        notes.append("no suspects to check")
    held, held_notes = held_gpus(health, [n for n in job_nodes if n not in suspects])
    notes += held_notes
    excluded = [*suspects, *held]
    removed = {*drained, *excluded}
    note, admitted = "; ".join(notes), []
    if health.spares and removed and job_nodes:
        # A spare that is already in service needs no admitting.
        ready = [s for s in health.spares if s not in removed and slurm.node_state(s) in HELD_STATES]
        if ready:
            spares = sweep(health, ready[: len(removed)], admit=True)
            admitted = spares.returned
            note += spare_note(spares)
    if health.spares and health.burn_in.min_ready_spares:
        short = fleet_places(health).spares_short
        note += f"; {short}" if short else ""
    return drained, excluded, admitted, note


def held_gpus(health, nodes: list[str]) -> tuple[list[str], list[str]]:
    """The gpu-processes check on the job's nodes that are not suspects (after a NaN, a hang or a
    preemption that is every node): a process the dead job left on a GPU keeps its memory from
    the relaunch. A node that fails it is excluded from the relaunch, not drained (a process to
    kill, not a fault, and the suspects' sweep has the drain caps); one the check cannot answer
    is named, not excluded. Nothing runs where the profile's checks leave gpu-processes out, and
    nothing is recorded for NVRx (one check passing readmits nothing)."""
    if not nodes or CheckName.GPU_PROCESSES not in health.checks:
        return [], []
    only = health.model_copy(update={"checks": [CheckName.GPU_PROCESSES]})
    run = run_health(only, nodes)
    failing = [r for r in run.reports if r.verdict.is_failure]
    unknown = [r for r in run.reports if r.verdict.exit_code and not r.verdict.is_failure]
    notes = [f"job node {r.node} {r.verdict.value}: {r.summary} (excluded)" for r in failing]
    notes += [f"job node {r.node} {r.verdict.value}: {r.summary} (not excluded)" for r in unknown]
    return [r.node for r in failing], notes


def spare_note(spares) -> str:
    """What the approver reads of the spares' admission (a ``Sweep`` with ``admit``): those put
    back, those with a warning (a conformance difference a profile lets pass), those refused."""
    note = f"; spares admitted: {', '.join(spares.returned)}" if spares.returned else ""
    for report in spares.run.reports:
        if report.node in spares.returned and report.verdict is Verdict.WARN:
            note += f"; spare {report.node} admitted with a warning: {report.summary}"
        elif spares.spares.get(report.node, Readiness.READY) != Readiness.READY:
            note += f"; spare {report.node} {spares.spares[report.node]}"
    return note


def relaunched_facts(profile, job: str) -> dict[str, dict | None] | None:
    """The relaunched Slurm job's nodes and their recorded conformance facts, which a resume
    validation names the odd ones of when throughput dropped; None without a health section or
    nodes to name (a local relaunch, a job slurmctld no longer knows: nothing to say, and no
    reason to fail the validation)."""
    if profile.health is None or profile.recovery.launcher != "slurm":
        return None
    try:
        nodes = jobs.slurm_job(job).nodes
    except CkptopsError:
        return None
    health = profile.health
    return fleet.recorded(health.raw_dir, nodes, health.conformance.max_age_days) if nodes else None


def failed_attempt(steps: Steps | None, slurm_job: str | None) -> Steps | None:
    """The failed attempt's records: its rows (a Slurm job's attempt id is its job id), else the
    last attempt's; None without records."""
    if steps is None or not len(steps):
        return None
    if steps.attempt.size != len(steps):
        return steps  # a log: no attempt ids
    ours = steps.attempt == str(slurm_job) if slurm_job else np.zeros(len(steps), dtype=bool)
    return steps.take(np.nonzero(ours if ours.any() else steps.attempt == steps.attempt[-1])[0])


def anomaly(tri: Triage, steps) -> int | None:
    if tri.anomaly_iteration is not None:
        return tri.anomaly_iteration
    if steps is not None and "nonfinite" in steps.columns:
        bad = np.nonzero(steps.columns["nonfinite"] > 0)[0]
        if bad.size:
            return int(steps.iteration[bad[0]])
    return tri.iteration


def read_steps(records: Path | None, logs: list[Path]) -> Steps | None:
    """The failed run's steps: its step records (``step_records.read_configured``), or, with none configured,
    Megatron-LM's iteration lines in the first of its ``logs`` that holds any (a job that
    writes only its log); None when neither has a step."""
    if records is not None:
        return read_configured(records)
    for log in logs:
        try:
            return load_steps(log)
        except (UsageError, Unreadable):
            continue
    return None


def roll_back(profile, iteration: int) -> None:
    promote(
        profile.job.save_dir,
        VerifyOptions.from_profile(profile),
        profile.verify.lock_timeout_seconds,
        requested=iteration,
    )


def account(incident: Incident, steps, checkpoint_dir: Path, trust: Trust) -> None:
    """Recomputed work and lost GPU-hours, from the records before the failure (the checkpoint's
    manifest read as ``trust`` asks)."""
    if incident.failure_iteration is None or incident.checkpoint is None:
        return
    recomputed = max(0, incident.failure_iteration - incident.checkpoint)
    incident.recomputed_iterations = recomputed
    facts = checkpoint_facts(checkpoint_dir, trust)
    per_step = facts.global_batch_size * (facts.seq_length or 0)
    incident.recomputed_tokens = recomputed * per_step if per_step else None
    step_seconds = 0.0
    if steps is not None and "step_seconds" in steps.columns:
        finite = steps.columns["step_seconds"][np.isfinite(steps.columns["step_seconds"])]
        step_seconds = float(np.median(finite)) if finite.size else 0.0
    t = incident.times
    start = t.get("first_error") or t.get("last_progress") or t.get("detected")
    downtime = (t.get("first_resumed_step") or time.time()) - start if start is not None else 0.0
    incident.lost_gpu_hours = round(lost_gpu_hours(incident.gpus or 0, downtime, recomputed, step_seconds), 4)
