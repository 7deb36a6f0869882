"""A recovery run: from a failed training job to a validated resume, or to a human.

The one composition of a recovery, which the flow (flows/recovery_run.py) and the CLI
(``ckptops recover``) both run. They differ only in how a human approves (a paused flow run
with a form, or a terminal prompt) and in how phases are shown (tasks in the UI, lines on a
terminal): ``approve`` and ``step`` are passed in.

Phases: detect (what failed, where), triage, stop rules, checkpoint (chosen, then verified
again), nodes (health, drain, exclude, spares), approval, relaunch, the relaunch's own printed
arguments, progress, validation.

One recovery per job at a time, one incident per failure:
- the job's recovery lock (``.ckptops-recovery.lock`` in the save directory) is held from the
  triage to the end, by the CLI and the flow alike;
- the incident is in the ledger from the start (``running``, with the failure's key) and is
  written again as each phase ends, so a recovery killed at any point leaves what it did;
- a second recovery of a failure another has in hand, or has relaunched for, relaunches nothing
  (``Duplicate``); under the lock an incident still ``running`` is one whose recovery was killed:
  its relaunched job, if it still runs, is adopted (watched and validated), else it is closed;
- SIGTERM and SIGINT close the incident as ``interrupted`` with what was done;
- a relaunch that misses its progress deadline is cancelled before the incident stops;
- a relaunch whose arguments, as Megatron-LM printed them in its own output, do not fit the
  checkpoint (a refused difference, or one no person approved) is stopped before it trains.
"""

import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path

import numpy as np

from tasks.checkpoint import layout
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.pins import pin
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.saves import room_to_save
from tasks.checkpoint.signing import Trust
from tasks.checkpoint.state import State, VerifyOptions
from tasks.cluster import process, slurm
from tasks.errors import CkptopsError, LockTimeout, UsageError
from tasks.job import step_records
from tasks.job.step_records import Steps
from tasks.recovery import job as jobs
from tasks.recovery.data import carried_skips, rerun_checkpoints, skip_not_printed, skip_plan
from tasks.recovery.guard import signal_name, signals_held, sigterm_ends_the_run, who
from tasks.recovery.ledger import (
    Incident,
    IncidentOutcome,
    ledger_path,
    new_id,
    read_ledger,
    record,
)
from tasks.recovery.phases import (
    Detected,
    Source,
    account,
    anomaly,
    certifications,
    choose_checkpoint,
    detect,
    failed_attempt,
    failure_key,
    nodes_phase,
    promote_pending,
    read_steps,
    relaunch_compatibility,
    relaunched_facts,
    reverify_checkpoint,
    roll_back,
    unusable,
)
from tasks.recovery.rules import Failure, Rule, fired, soon_after_resume, stop_rules
from tasks.recovery.triage import Triage, attribute_hang, triage
from tasks.recovery.triage.model import FailureClass
from tasks.relaunch.fit import Compatibility, Difference
from tasks.relaunch.launch import Launch
from tasks.relaunch.printed import PrintedArgs, fit_printed
from tasks.restore.history import drilled_layouts
from tasks.resume.validate import validate_resume


@dataclass
class RecoveryPlan:
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
    certified: dict[int, bool | None] = field(default_factory=dict)  # each choice's continuation drill
    fits: Compatibility | None = None  # the relaunch script's flags against the checkpoint's args


@dataclass
class Decision:
    approve: bool
    by: str
    checkpoint: int | None = None  # another checkpoint than the plan's
    note: str = ""


# Log times are read as UTC (tasks.recovery.triage), but a job may print its own zone's: such a
# time read as UTC is at most 14 hours (UTC+14) after the moment it names.
LOG_ZONE_HOURS = 14


def job_started(attempt: str | None, logs_began: float | None) -> float | None:
    """When the failed job started, to tell its Flight Recorder dumps from an earlier run's:
    Slurm's StartTime (``Detected.attempt`` is ``restarts:StartTime``, scontrol's local time),
    else the logs' first time less LOG_ZONE_HOURS; None where neither is known."""
    start = (attempt or "").partition(":")[2]
    try:
        return datetime.fromisoformat(start).timestamp()
    except ValueError:
        pass
    return None if logs_began is None else logs_began - LOG_ZONE_HOURS * 3600


class Duplicate(CkptopsError):
    """Another recovery has this failure in hand, or already relaunched the job for it: this one
    relaunches nothing and writes no incident of its own."""

    exit_code = 3

    def __init__(self, message: str, incident: Incident):
        super().__init__(message)
        self.incident = incident


# sinfo's short states of a node that is out of service (drained, draining, down).


def plain_step(name: str, fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


_NUMERICAL = (FailureClass.NUMERICS, FailureClass.DATA)
_ADOPTABLE = ("RUNNING", "PENDING", "CONFIGURING", "REQUEUED", "SUSPENDED")
_LOCK_POLL_SECONDS = 0.5


class _Recovery:
    def __init__(self, profile, source: Source, trigger: str, approve, step, flow_run, warn, retry):
        if profile.recovery is None:
            raise UsageError(f"{profile.source}: no recovery section")
        self.profile, self.settings, self.source = profile, profile.recovery, source
        self.save_dir = profile.job.save_dir
        self.approve, self.step, self.warn, self.retry = approve, step, warn, retry
        self.incident = Incident(new_id(), profile.job.name, trigger, source.slurm_job, flow_run=flow_run)
        self.phase = "detect"
        self.records = step_records.configured(profile)
        self.steps: Steps | None = None
        self.failed_steps: Steps | None = None
        self.detected: Detected | None = None
        self.tri: Triage | None = None
        self.rules: list[Rule] = []
        self.resumed: Incident | None = None  # the last relaunch, if it turned numerically bad soon
        self.window: list[int] = []  # a data failure's iterations, to relaunch past
        self.history: list[Incident] = []  # the job's other incidents, as the stop rules read them

    @cached_property
    def trust(self) -> Trust:
        """The job's signing policy, built once when a phase first reads the job's manifests."""
        return Trust.of(self.profile)

    def _save(self) -> None:
        try:
            record(self.save_dir, self.incident)
        except OSError as e:  # a full or read-only store: one line that says so
            raise CkptopsError(f"{ledger_path(self.save_dir)}: the incident cannot be written: {e}") from None

    def _do(self, name: str, fn, *args, **kwargs):
        """One phase: shown by ``step`` (a task in the UI, a line on a terminal)."""
        self.phase = name
        return self.step(name, fn, *args, **kwargs)

    def _stop(self, reason: str, outcome: IncidentOutcome = IncidentOutcome.STOPPED) -> None:
        self.incident.outcome, self.incident.reason = outcome, reason

    # The run as a whole.

    def run(self, started) -> Incident:
        incident = self.incident
        incident.mark("detected")
        try:
            self._triage()
        except CkptopsError as e:
            return self._closed(str(e))
        except Exception:
            self._closed(f"the recovery run failed during {self.phase} (a fault in ckptops)")
            raise
        incident.failure_key = failure_key(self.source, self.tri, self.detected)
        try:
            lock = self._lock()
        except Duplicate:
            raise
        except LockTimeout as e:
            return self._closed(f"another recovery of {incident.job} holds its recovery lock: {e}")
        except CkptopsError as e:  # a lock file or holder of another account: refused at once
            return self._closed(f"the recovery lock of {incident.job} is refused: {e}")
        with lock:
            try:
                adoptable = self._resolve_leftovers()
            except CkptopsError as e:
                return self._closed(str(e))
            if adoptable is not None:
                return self._adopt(adoptable, started)
            self._refuse_duplicate()
            incident.outcome, incident.owner = IncidentOutcome.RUNNING, process.identity()
            self._save()
            self._guarded(self._phases, started)
        return self.incident

    def _closed(self, reason: str) -> Incident:
        """An incident that stopped before it held the recovery: written once, as stopped."""
        self._stop(reason)
        self._save()
        return self.incident

    def _guarded(self, phases, started) -> None:
        """Tell ``started``, run ``phases``; however they end, the incident is closed and
        recorded. A signal that ends them carries the incident out (``error.incident``)."""
        try:
            if started:
                started(self.incident)
            phases()
        except CkptopsError as e:
            self._stop(str(e))
        except BaseException as e:
            if not isinstance(e, Exception):  # a signal: SIGTERM, SIGINT, Prefect's cancellation
                self._stop(
                    f"interrupted by {signal_name(e)} during {self.phase}; {self._done()}",
                    IncidentOutcome.INTERRUPTED,
                )
                e.incident = self.incident
            raise
        finally:
            if self.incident.outcome == IncidentOutcome.RUNNING:
                self._stop(f"the recovery run failed during {self.phase} (a fault in ckptops)")
            try:
                self._save()
            except CkptopsError as e:
                self.warn(str(e))

    def _done(self) -> str:
        job = self.incident.relaunched_job
        if job is None:
            return "nothing was relaunched"
        return f"relaunched {job} from {self.incident.checkpoint}; the next recovery adopts it while it runs"

    def _lock(self) -> ExitStack:
        """The job's recovery lock. While another recovery holds it, one of the same failure
        reports that one (``Duplicate``) as soon as its incident is in the ledger; any other
        waits its turn (``recovery.lock_timeout_seconds``)."""
        deadline = time.monotonic() + self.settings.lock_timeout_seconds
        ours = self.incident.failure_key
        while True:
            stack = ExitStack()
            try:
                stack.enter_context(job_lock(self.save_dir, 0, layout.RECOVERY_LOCK))
                return stack
            except LockTimeout:
                if time.monotonic() >= deadline:
                    raise
            for other in read_ledger(self.save_dir).incidents:
                if other.running and other.failure_key == ours:
                    raise Duplicate(
                        f"incident {other.id} is recovering this failure ({ours}) in "
                        f"{who(other.owner)}; nothing relaunched",
                        other,
                    )
            time.sleep(_LOCK_POLL_SECONDS)

    def _resolve_leftovers(self) -> Incident | None:
        """Under the lock, an incident still ``running`` was left by a recovery that was killed.
        The relaunch it (or an interrupted one) made, if it still runs, is the one to adopt; the
        others are closed as interrupted."""
        ledger = read_ledger(self.save_dir)
        for problem in ledger.problems:
            self.warn(problem)
        adoptable = None
        for old in ledger.incidents:
            if old.job != self.incident.job or old.outcome not in (
                IncidentOutcome.RUNNING,
                IncidentOutcome.INTERRUPTED,
            ):
                continue
            if old.running and old.relaunch_token and not old.relaunched_job:
                # Killed between submitting the relaunch and recording it: found by its token.
                found = jobs.find_by_token(self._job_name(), old.relaunch_token, self.settings.launcher)
                if found:
                    old.relaunched_job, old.relaunch_process = found
            job = old.relaunched_job
            state = (
                jobs.job_state(job, old.relaunch_process) if job and "validated" not in old.times else None
            )
            if state == jobs.ELSEWHERE:
                raise CkptopsError(
                    f"incident {old.id} relaunched {job} on {old.relaunch_process['host']}, where it may "
                    "still run: recover there, or end it and its incident first"
                )
            if state in _ADOPTABLE and job != self.source.slurm_job:
                adoptable = old
            elif old.running:
                if job is not None and job == self.source.slurm_job:
                    ended = f"its relaunch {job} failed: incident {self.incident.id} recovers that"
                else:
                    ended = (
                        f"its relaunched job {job} is no longer running" if job else "nothing was relaunched"
                    )
                old.outcome, old.reason = IncidentOutcome.INTERRUPTED, f"{who(old.owner)} was killed; {ended}"
                record(self.save_dir, old)
        return adoptable

    def _refuse_duplicate(self) -> None:
        """A failure recovered once is not recovered again unless asked (``retry``): an approver's
        no stands. A recovery interrupted before it relaunched anything is simply taken up again,
        and one that relaunched is never repeated."""
        ours = self.incident.failure_key
        for other in read_ledger(self.save_dir).incidents:
            if other.failure_key != ours or (
                other.outcome == IncidentOutcome.INTERRUPTED and not other.relaunched_job
            ):
                continue
            if other.relaunched_job or not self.retry:
                raise Duplicate(
                    f"incident {other.id} already handled this failure ({ours}): {other.outcome}"
                    + (
                        f", relaunched {other.relaunched_job}"
                        if other.relaunched_job
                        else ", recover it again with --retry (the CLI) or retry: true (the flow)"
                    )
                    + "; nothing relaunched",
                    other,
                )

    def _adopt(self, old: Incident, started) -> Incident:
        """Watch and validate the job a killed recovery relaunched, as that recovery would have."""
        note = f"adopted after {who(old.owner)} ended; "
        self.incident = old
        old.outcome, old.owner = IncidentOutcome.RUNNING, process.identity()
        self._save()

        def watch() -> None:
            steps = step_records.read_configured(self.records)
            before = old.records_before or 0
            self.failed_steps = (
                failed_attempt(steps.take(np.arange(min(before, len(steps)))), old.failed_job)
                if steps
                else None
            )
            self._watch()

        self._guarded(watch, started)
        old.reason = note + (old.reason or "")
        self._save()
        return old

    # The phases.

    def _triage(self) -> None:
        incident = self.incident
        self.detected = self._do("detect", detect, self.profile, self.source)
        self.tri = tri = self._do(
            "triage",
            triage,
            self.detected.logs,
            self.detected.layout or None,
            self.detected.exit_code,
            self.profile.health.critical_xids if self.profile.health else None,
        )
        dumps = self.profile.recovery.flight_recorder_dir
        if dumps is not None and tri.cls in (FailureClass.HANG, FailureClass.UNKNOWN):
            self._flight_recorder(dumps)
        incident.mark("triaged")
        incident.cls, incident.exit_code = tri.cls, tri.exit_code
        tri.infrastructure = tri.infrastructure or self.detected.infrastructure
        incident.infrastructure = tri.infrastructure
        incident.first_error = tri.to_dict()["first_error"]
        incident.suspect_nodes = list(tri.suspect_nodes)
        incident.suspect_gpus = list(tri.suspect_gpus)
        if tri.first_error is not None and tri.first_error.at is not None:
            incident.mark("first_error", tri.first_error.at)

    def _flight_recorder(self, dumps: Path) -> None:
        """The ranks' dumps, for a hang or a failure the logs do not explain. Only those written
        since the failed job started count (an earlier run's would make an unknown failure a
        hang); where no start is known, an unknown failure's are not read at all."""
        tri, incident = self.tri, self.incident
        since = job_started(self.detected.attempt, tri.logs_began)
        if since is None and tri.cls == FailureClass.UNKNOWN:
            self.warn(
                f"{dumps}: Flight Recorder dumps not read: when the failed job started is unknown (no "
                "Slurm start, no time in its logs), so an earlier run's cannot be told apart"
            )
            return
        # The Slurm layout has a task a node under torchrun: no world size (attribute_hang).
        layout = self.detected.layout or None
        self._do("flight-recorder", attribute_hang, tri, dumps, layout, required=False, since=since)
        for problem in tri.flight_recorder["problems"]:
            self.warn(problem)
        incident.hang = tri.flight_recorder["reason"] if tri.cls == FailureClass.HANG else None

    def _phases(self) -> None:
        incident, settings = self.incident, self.settings
        self.steps = self._do("step-records", read_steps, self.records, self.detected.logs)
        self.failed_steps = failed_attempt(self.steps, self.source.slurm_job)
        if self.failed_steps is not None:
            incident.failure_iteration = int(self.failed_steps.iteration[-1])
            incident.mark("last_progress", float(self.failed_steps.time[-1]))
        else:
            incident.failure_iteration = self.tri.iteration
        incident.promoted_at_failure, promotion = self._do("promote-pending", promote_pending, self.profile)
        incident.gpus = settings.gpus or self.profile.job.layout.world_size
        self._save()
        if self._rules_stop() or not self._data_window() or not self._room_to_save():
            return
        chosen, choices = self._choose()
        # Before any node is drained: a relaunch its own script would refuse is not prepared for.
        fits = self._fits(chosen) if chosen is not None else None
        if chosen is not None and fits is None:
            return
        drained, exclude, admitted, health_note = self._do(
            "nodes", nodes_phase, self.profile, incident, incident.suspect_nodes, self.detected.nodes
        )
        incident.health = health_note
        incident.drained, incident.excluded, incident.admitted = drained, exclude, admitted
        incident.mark("health_done")
        self._save()
        if not self._capacity(exclude):
            return
        if chosen is None:
            self._stop(f"no usable checkpoint to resume from: {unusable(self.profile)}")
            return
        chosen = self._approval(chosen, choices, drained, exclude, admitted, fits)
        if chosen is None:
            return
        self._relaunch(chosen, exclude)
        self._watch()

    def _rules_stop(self) -> bool:
        incident = self.incident
        failure = Failure(
            self.tri.cls,
            incident.failure_iteration,
            self.tri.exit_code,
            incident.promoted_at_failure,
            time.time(),
            incident.failure_key,
            incident.infrastructure,
            anomaly(self.tri, self.steps) if self.tri.cls in _NUMERICAL else None,
        )
        # Running incidents count too: the ledger has every incident from its start.
        self.history = history = [
            i for i in read_ledger(self.save_dir).incidents if i.job == incident.job and i.id != incident.id
        ]
        within = self.settings.fallback_within_iterations
        rules = self._do("stop-rules", stop_rules, failure, history, self.settings.max_per_hour, within)
        incident.rules = [r.to_dict() for r in rules]
        self.rules = rules
        self.resumed = soon_after_resume(failure, history, within)
        if fired(rules):
            # A human decides from here: nothing is drained, chosen or relaunched.
            self._stop("stop rule: " + "; ".join(f"{r.name}: {r.detail}" for r in fired(rules)))
            incident.stop_rule = fired(rules)[0].name
            return True
        return False

    def _room_to_save(self) -> bool:
        """A failed save: a relaunch into a store that cannot take the next save fails again at
        that save (or worse, half-way through it); the recovery stops with the space needed and
        what retention could free. False, with the incident stopped, in that case."""
        if self.tri.cls != FailureClass.SAVE_FAILED:
            return True
        short = self._do("store-space", room_to_save, self.profile, VerifyOptions.from_profile(self.profile))
        if short is None:
            return True
        self._stop(short)
        return False

    def _data_window(self) -> bool:
        """A data failure: the iteration to relaunch past, where the profile lets a relaunch skip
        it (``recovery.skip_bad_data``); False, with the incident stopped, where it does not."""
        if self.tri.cls != FailureClass.DATA:
            return True
        at = self.tri.anomaly_iteration  # the verdict's own: never a guess from the steps
        if at is None:
            self._stop("a data failure at an iteration no line names: a person decides what to skip")
            return False
        if self.settings.skip_bad_data == "never":
            self._stop(
                f"a data failure at iteration {at} (recovery.skip_bad_data: never): a person decides; "
                f"Megatron-LM's --iterations-to-skip {at} relaunches past it"
            )
            return False
        self.window = [at]
        return True

    def _choose(self) -> tuple[int | None, list[int]]:
        """The checkpoint to resume from, verified again: one that no longer verifies is marked
        invalid (the pointer moves off it) and the next is chosen. Past a data failure, not one
        the rerun state machine saved to rerun the bad iteration."""
        before = anomaly(self.tri, self.steps) if self.tri.cls in _NUMERICAL else None
        passed: tuple[int, ...] = ()
        if self.window:
            _, candidates = choose_checkpoint(self.profile, self.incident.failure_iteration, before)
            passed = self._do("rerun-checkpoints", rerun_checkpoints, self.save_dir, candidates, self.trust)
        if self.resumed is not None:  # the checkpoint the last relaunch loaded is suspect
            before, incident = self.resumed.checkpoint, self.incident
            incident.fallback_from = before
            incident.fallback = (
                f"numerics at iteration {incident.failure_iteration}, "
                f"{incident.failure_iteration - before} iterations after {self.resumed.id} resumed from "
                f"checkpoint {before} (recovery.fallback_within_iterations "
                f"{self.settings.fallback_within_iterations}): "
                "falling back to the verified checkpoint before it"
            )
        while True:
            failed = tuple(r["iteration"] for r in self.incident.reverified if r["outcome"] != "pass")
            failed += passed
            chosen, choices = self._do(
                "choose-checkpoint",
                choose_checkpoint,
                self.profile,
                self.incident.failure_iteration,
                before,
                failed,
            )
            if chosen is None or self._reverified(chosen):
                return chosen, choices

    def _reverified(self, iteration: int) -> bool:
        """Whether ``iteration`` passes its verification again (done once per recovery). One
        that was being written while it was read is no verdict: the recovery stops."""
        done = [r for r in self.incident.reverified if r["iteration"] == iteration]
        if not done:
            done = [self._do("reverify", reverify_checkpoint, self.profile, iteration)]
            self.incident.reverified.append(done[0])
            self.incident.mark("reverified")
            self._save()
        if done[-1]["state"] == str(State.IN_PROGRESS):
            raise CkptopsError(
                f"{layout.iter_dir_name(iteration)} changed while it was verified again "
                f"({done[-1]['reason']}): something is writing the checkpoint a relaunch would read"
            )
        return done[-1]["outcome"] == "pass"

    def _capacity(self, exclude: list[str]) -> bool:
        settings, detected = self.settings, self.detected
        needed = settings.nodes or len(detected.nodes)
        if settings.launcher == "slurm" and detected.partition and needed:
            # A relaunch needing more nodes than are in service would wait in the queue forever.
            usable = self._do("capacity", slurm.usable_nodes, detected.partition, exclude)
            if len(usable) < needed:
                self._stop(
                    f"the job needs {needed} nodes; partition {detected.partition} has {len(usable)} in "
                    f"service outside the excluded {', '.join(exclude) or 'none'}"
                )
                return False
        return True

    def _job_name(self) -> str:
        return self.settings.job_name or self.profile.job.name

    def _log_dir(self) -> Path:
        return self.settings.log_dir or self.save_dir.parent / "logs"

    def _approval(self, chosen, choices, drained, exclude, admitted, fits) -> int | None:
        """The approver's decision; the checkpoint to relaunch from, or None (stopped)."""
        incident, settings = self.incident, self.settings
        skip = self._skip(chosen)
        relaunch = (
            " ".join(
                jobs.sbatch_command(settings, self._job_name(), chosen, exclude, self._log_dir(), skip=skip)
            )
            if settings.launcher == "slurm"
            else " ".join(["bash", *Launch(settings.script, chosen, settings.pass_step, skip=skip).argv()])
        )
        certified = certifications(self.profile, choices)
        plan = RecoveryPlan(
            incident,
            self.tri,
            self.rules,
            chosen,
            choices,
            drained,
            exclude,
            admitted,
            relaunch,
            certified,
            fits,
        )
        incident.mark("approval_requested")
        self._save()
        self.phase = "approval"
        if self.window and settings.skip_bad_data == "auto" and not fits.needs_approval:
            decision = Decision(True, "auto: recovery.skip_bad_data is auto")
        elif not self.window and self.tri.cls in settings.auto_approve and not fits.needs_approval:
            decision = Decision(True, f"auto: {self.tri.cls} is in recovery.auto_approve")
        else:
            decision = self.approve(plan)
        if not decision.approve:
            note = f": {decision.note}" if decision.note else ""
            self._stop(f"not approved ({decision.by}){note}", IncidentOutcome.ABORTED)
            return None
        incident.mark("approved")
        # What a person approved (nothing, when auto-approved: then nothing needed approval).
        incident.approved_args = [d.name for d in fits.needs_approval]
        if decision.checkpoint is not None and decision.checkpoint != chosen:
            if decision.checkpoint not in choices:
                self._stop(f"checkpoint {decision.checkpoint} is not a verified candidate ({choices})")
                return None
            chosen = decision.checkpoint
            if not self._reverified(chosen):
                self._stop(f"checkpoint {chosen}, the approver's choice, failed re-verification")
                return None
            other = self._fits(chosen, fits.versions)
            if other is None:
                return None
            shown = {d.words for d in fits.needs_approval}
            unseen = [d.words for d in other.needs_approval if d.words not in shown]
            if unseen:
                self._stop(
                    f"checkpoint {chosen}, the approver's choice, differs from the relaunch in what the "
                    f"approval form did not show: {'; '.join(unseen)}"
                )
                return None
            incident.approved_args = [d.name for d in other.needs_approval]
            self._skip(chosen)
        return chosen

    def _skip(self, chosen: int) -> tuple[int, ...]:
        """The iterations a relaunch from ``chosen`` passes untrained: this data failure's, and
        those earlier relaunches skipped after ``chosen`` (the data there is still bad); the plan
        is kept in the incident."""
        skip = sorted({*self.window, *carried_skips(self.history, chosen)})
        self.incident.skipped = (
            self._do("skip-plan", skip_plan, self.save_dir, chosen, skip, self.trust) if skip else None
        )
        return tuple(skip)

    def _fits(self, chosen: int, versions: dict | None = None) -> Compatibility | None:
        """The relaunch script against checkpoint ``chosen`` (kept in the incident); None, with
        the incident stopped, when a difference refuses the relaunch outright."""
        fits = self._do("compare-args", relaunch_compatibility, self.profile, chosen, versions)
        self.incident.relaunch_args = [fits.summary(), *fits.lines()]
        self._save()
        if fits.refused:
            self._stop(
                f"relaunch refused: the script does not fit checkpoint {chosen}: "
                + "; ".join(d.words for d in fits.refused)
                + " (fix the script, then `ckptops recover --retry`)"
            )
            return None
        return fits

    def _relaunch(self, chosen: int, exclude: list[str]) -> None:
        incident, settings = self.incident, self.settings
        incident.checkpoint = chosen
        if read_pointer(self.save_dir) != chosen:
            # A rollback (numerics, or the approver's pick) goes through the pointer, with a hold,
            # as an operator's would: the pointer stays the one record of what the job resumed from.
            self._do("roll-back-pointer", roll_back, self.profile, chosen)
        if incident.fallback_from is not None:
            # Kept whatever retention or a later rollback decides, until an operator unpins it.
            why = f"fallen back to from {incident.fallback_from} by {incident.id}"
            self._do("pin-fallback", pin, self.save_dir, chosen, f"recovery-{incident.id}", why)
        running = self._do("already-running", self._running_copy)
        if running:
            raise CkptopsError(f"{running}: not relaunching a second copy")
        # The job is down: the records read at triage are all there are until the relaunch writes.
        incident.records_before = len(self.steps) if self.steps is not None else 0
        # The intent first; then the job and the line naming it, with signals held in between.
        incident.relaunch_token = incident.id
        self._save()
        with signals_held():
            if settings.launcher == "slurm":
                command = jobs.sbatch_command(
                    settings,
                    self._job_name(),
                    chosen,
                    exclude,
                    self._log_dir(),
                    incident.relaunch_token,
                    tuple(incident.skipped["iterations"]) if incident.skipped else (),
                )
                new = self._do("relaunch", jobs.submit, settings, command, self._log_dir())
            else:
                new, incident.relaunch_process, log = self._do(
                    "relaunch",
                    jobs.start_local,
                    settings,
                    incident.job,
                    chosen,
                    self._log_dir(),
                    incident.relaunch_token,
                    tuple(incident.skipped["iterations"]) if incident.skipped else (),
                )
                incident.relaunch_log = str(log)
            incident.relaunched_job = new
            incident.mark("relaunch_submitted")
            self._save()
        if settings.launcher == "slurm":
            # Where the relaunch's own lines start in an output file earlier runs may have written.
            incident.relaunch_log_offset = jobs.output_offset(new)
            self._save()

    def _running_copy(self) -> str | None:
        """A copy of the job that still runs: on Slurm a job of the singleton name, queued or
        running; locally a relaunch of this job (by its environment), or an earlier incident's
        relaunch the ledger names (here, or on another host). What it is, or None."""
        if self.settings.launcher == "slurm":
            ids = slurm.run(["squeue", "-h", "--name", self._job_name(), "-o", "%i %T"]).split("\n")
            live = [
                line.split()[0] for line in ids if line.split() and line.split()[0] != self.source.slurm_job
            ]
            return f"Slurm job {live[0]} ({self._job_name()}) is queued or running" if live else None
        copies = jobs.local_copies(self.incident.job)
        if copies:
            return f"local:{copies[0]}, a relaunch of {self.incident.job}, still runs"
        for other in read_ledger(self.save_dir).incidents:
            job = other.relaunched_job
            if job and other.id != self.incident.id and jobs.alive(job, other.relaunch_process):
                return f"{job}, relaunched by incident {other.id}, may still run"
        return None

    def _sources(self) -> list[jobs.Watched]:
        """Where the relaunch's steps are read: the job's step records past those of the failed
        run (a recorder's, or a log the job's script appends to), then the relaunch's own output
        (a local relaunch's file, the Slurm job's StdOut) from where it started."""
        incident, sources = self.incident, []
        if self.records is not None:
            sources.append(jobs.Watched(Path(self.records), before=incident.records_before or 0))
        log = incident.relaunch_log
        if log and (self.records is None or Path(log) != Path(self.records)):
            sources.append(jobs.Watched(Path(log), start=incident.relaunch_log_offset))
        return sources

    def _fits_as_printed(self, new: str, holder: dict | None) -> bool:
        """Megatron-LM's own printed arguments, read from the relaunch's own output as soon as they
        are there, against the checkpoint: the authority the script's pre-check could only read
        as text. A relaunch they do not fit (a refused difference, or one that needs an approval
        no person gave) is stopped before it trains, and the incident says which argument and
        why. True when the relaunch may go on (its arguments fit, or were not printed where it
        writes: then the pre-check stands, as the incident says)."""
        incident = self.incident
        log, cwd = jobs.relaunch_output(new, holder, incident.relaunch_log)
        if log is None:
            incident.printed_args = [
                "the relaunch's output file is not known: Megatron-LM's arguments not read"
            ]
            return True
        incident.relaunch_log = str(log)
        try:
            printed = self._do(
                "printed-args",
                jobs.wait_printed,
                new,
                log,
                self._sources(),
                self.settings.progress_timeout_seconds,
                holder,
                incident.relaunch_log_offset,
            )
        except CkptopsError as e:
            printed, unread = None, f"Megatron-LM's arguments not read: {e}"
        else:
            unread = (
                f"{log}: no Megatron-LM arguments block before the job trained or ended: "
                "the script's pre-check stands"
            )
        if printed is None:
            incident.printed_args = [unread]
            self._save()
            return True
        checkpoint = self.save_dir / layout.iter_dir_name(incident.checkpoint)
        fit = fit_printed(printed, checkpoint, drilled_layouts(self.save_dir), cwd, self.trust)
        incident.printed_args = [fit.summary(), *fit.lines()]
        unapproved = [d for d in fit.needs_approval if not self._approved(d, printed)]
        unskipped = skip_not_printed(printed, incident.skipped) if incident.skipped else None
        if incident.skipped and not unskipped:
            incident.skipped["confirmed"] = True  # Megatron-LM was told: the skip takes effect
        if not fit.refused and not unapproved and not unskipped:
            self._save()
            return True
        why = [d.words for d in fit.refused] + [f"{d.words} (no person approved this)" for d in unapproved]
        why += [unskipped] if unskipped else []
        stopped = jobs.cancel(new, holder, hard=True)  # no save on its way out
        trained = jobs.logged_iterations(log, incident.relaunch_log_offset)
        self._stop(
            f"relaunch {new} does not fit checkpoint {incident.checkpoint} by the arguments Megatron-LM "
            f"printed ({printed.where()}): {'; '.join(why)}; {stopped} "
            + (f"after {trained} logged iterations" if trained else "before its first iteration")
        )
        return False

    def _approved(self, printed_difference: Difference, printed: PrintedArgs) -> bool:
        """Whether a person approved this very difference: the same argument, with the same
        values on both sides, as the pre-check showed on the approval form."""
        if printed_difference.name not in self.incident.approved_args:
            return False
        words = printed_difference.words
        shown = [
            line.removeprefix("approve: ")
            for line in self.incident.relaunch_args
            if line.startswith("approve: ")
        ]
        marker = f"{printed_difference.name} (printed at {printed.where()})"
        values = words.split(marker, 1)[1] if marker in words else None
        return any(line == words or (values is not None and line.endswith(values)) for line in shown)

    def _watch(self) -> None:
        """Wait for the relaunched job to run and make progress, then validate the resume. A job
        that misses a deadline is cancelled before the incident stops."""
        incident, settings = self.incident, self.settings
        new, holder = incident.relaunched_job, incident.relaunch_process
        try:
            state = self._do(
                "wait-running", jobs.wait_running, new, settings.progress_timeout_seconds, holder
            )
            incident.mark("job_running")
            self._save()
            if not self._fits_as_printed(new, holder):
                return
            sources = self._sources()
            if not sources:
                self._stop(
                    f"relaunched ({new}, {state}); neither its output nor recovery.step_records is known "
                    f"to watch its progress or validate: {jobs.cancel(new, holder)}"
                )
                return
            watched, progress = self._do(
                "wait-progress",
                jobs.wait_progress,
                new,
                sources,
                settings.progress_steps,
                settings.progress_timeout_seconds,
                holder,
            )
        except CkptopsError as e:
            self.phase = "cancel"
            raise CkptopsError(f"{e}; {jobs.cancel(new, holder)}") from None
        incident.mark("first_resumed_step", progress.first_step_at)
        self._save()
        checkpoint_dir = self.save_dir / layout.iter_dir_name(incident.checkpoint)
        resumed = watched.steps()
        incident.watched = str(watched)
        nodes = relaunched_facts(self.profile, new)
        result = self._do(
            "validate-resume",
            validate_resume,
            checkpoint_dir,
            self.failed_steps,
            resumed,
            self.profile.resume,
            relaunched=nodes,
            trust=self.trust,
            skip=incident.skipped["iterations"] if incident.skipped else (),
        )
        incident.mark("validated")
        incident.validation = result.line()
        if incident.skipped and result.ok:
            incident.skipped["confirmed"] = True  # the log shows the window passed untrained
        account(incident, self.failed_steps, checkpoint_dir, self.trust)
        if result.ok:
            self._stop(
                f"resumed from {incident.checkpoint} as {new}; {result.line()}", IncidentOutcome.COMPLETED
            )
        elif settings.on_rejected == "warn":
            self._stop(
                f"resume rejected, job left running (recovery.on_rejected: warn): {result.line()}",
                IncidentOutcome.WARNED,
            )
        else:
            self._stop(f"resume rejected, {jobs.cancel(new, holder)}: {result.line()}")


def recover(
    profile,
    source: Source,
    trigger: str,
    approve: Callable[[RecoveryPlan], Decision],
    step: Callable = plain_step,
    flow_run: str | None = None,
    started: Callable[[Incident], None] | None = None,
    warn: Callable[[str], None] = _to_stderr,
    retry: bool = False,
) -> Incident:
    """Run one recovery; its incident is in the ledger from its start, as far as it got when
    this returns or raises. ``started`` is told the incident once it holds the job's recovery
    (the flow emits an event); ``warn`` gets the ledger lines that could not be used. Raises
    ``Duplicate`` when another recovery has this failure in hand or has handled it (``retry``:
    recover a failure again whose recovery relaunched nothing, after an approver's no)."""
    with sigterm_ends_the_run():
        return _Recovery(profile, source, trigger, approve, step, flow_run, warn, retry).run(started)
