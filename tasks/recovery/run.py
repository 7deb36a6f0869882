"""A recovery run: from a failed training job to a validated resume, or to a human.

The one composition of a recovery, which the flow (flows/recovery_run.py) and the CLI
(``ckptops recover``) both run. They differ only in how a human approves (a paused flow run
with a form, or a terminal prompt) and in how phases are shown (tasks in the UI, lines on a
terminal): ``approve`` and ``step`` are passed in.

Phases: detect (what failed, where), triage, stop rules, checkpoint (chosen, then verified
again), nodes (health, drain, exclude, spares), approval, relaunch, progress, validation.

One recovery per job at a time, one incident per failure:
- the job's recovery lock (``.ckptops-recovery.lock`` in the save directory) is held from the
  triage to the end, by the CLI and the flow alike;
- the incident is in the ledger from the start (``running``, with the failure's key) and is
  written again as each phase ends, so a recovery killed at any point leaves what it did;
- a second recovery of a failure another has in hand, or has relaunched for, relaunches nothing
  (``Duplicate``); under the lock an incident still ``running`` is one whose recovery was killed:
  its relaunched job, if it still runs, is adopted (watched and validated), else it is closed;
- SIGTERM and SIGINT close the incident as ``interrupted`` with what was done;
- a relaunch that misses its progress deadline is cancelled before the incident stops.
"""

import hashlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tasks.checkpoint import layout
from tasks.checkpoint.catalog import catalog
from tasks.checkpoint.facts import checkpoint_facts
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.manifest import valid_for_this_save
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.promote import promote, reverify
from tasks.checkpoint.state import State, VerifyOptions
from tasks.cluster import process, slurm
from tasks.errors import CkptopsError, Interrupted, LockTimeout, UsageError
from tasks.health.actions import apply_drains, plan_drains, spare_readiness
from tasks.health.run import run_health
from tasks.recovery import job as jobs
from tasks.recovery.ledger import (
    ABORTED,
    COMPLETED,
    INTERRUPTED,
    RUNNING,
    STOPPED,
    WARNED,
    Incident,
    ledger_path,
    lost_gpu_hours,
    new_id,
    read_ledger,
    record,
)
from tasks.recovery.rules import Failure, Rule, fired, stop_rules
from tasks.recovery.triage import Triage, triage
from tasks.resume.records import Steps, load_steps
from tasks.resume.validate import validate_resume
from tasks.storage.local import open_regular


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


class Duplicate(CkptopsError):
    """Another recovery has this failure in hand, or already relaunched the job for it: this one
    relaunches nothing and writes no incident of its own."""

    exit_code = 3

    def __init__(self, message: str, incident: Incident):
        super().__init__(message)
        self.incident = incident


# sinfo's short states of a node that is out of service (drained, draining, down).
_HELD_STATES = ("drain", "drng", "down")


def plain_step(name: str, fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


@dataclass
class Detected:
    """What is known of the failed job before reading its logs."""

    logs: list[Path]
    layout: dict[int, str]  # rank -> node
    exit_code: int | None
    nodes: list[str]
    partition: str | None
    attempt: str | None = None  # the Slurm job's start: its requeues and start time


def detect(profile, source: Source) -> Detected:
    """The logs to read, the rank -> node layout, the exit code, the job's nodes and partition."""
    found = Detected(list(source.logs), {}, source.exit_code, [], None)
    if source.slurm_job:
        job = jobs.slurm_job(source.slurm_job)
        found.layout, found.nodes, found.partition = job.layout(), job.nodes, job.partition
        found.attempt = f"{job.restarts}:{job.start_time}"
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
    """The newest verified checkpoint at or before the failure (and before ``before``, the start
    of a numerical anomaly), not one of ``passed_over``. Never Megatron's tracker: the promotion
    pointer and the manifests decide. Returns it and every candidate, newest first."""
    save_dir = profile.job.save_dir
    options = VerifyOptions.from_profile(profile)
    candidates = []
    for info in catalog(save_dir, options):
        if info.state is not State.VALID or info.stale or info.iteration in passed_over:
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


def _records(profile) -> Path | None:
    return profile.recovery.step_records if profile.recovery else None


def _read_records(records: Path | None) -> Steps | None:
    """The job's step records: a configured path must be a file (nothing is relaunched that
    could never be watched or validated); one without a record yet holds no steps."""
    if records is None:
        return None
    try:
        open_regular(records).close()
    except UsageError as e:
        raise UsageError(
            f"recovery.step_records: {e}; a relaunch could neither be watched nor validated"
        ) from None
    if Path(records).stat().st_size == 0:
        return None
    return load_steps(records)


def _who(owner: dict | None) -> str:
    if not owner:
        return "a recovery run"
    return f"the recovery run (pid {owner.get('pid')} on {owner.get('host')})"


@contextmanager
def _sigterm_ends_the_run():
    """SIGTERM (what ``timeout``, systemd and Prefect send) raises ``Interrupted`` in the main
    thread, so the incident is closed on the way out; SIGINT already raises KeyboardInterrupt.
    Left alone where someone else handles SIGTERM (Prefect's flow engine raises its own
    TerminationSignal, a BaseException too) or off the main thread."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def _raise(signum, frame):
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def _signals_held():
    """SIGTERM and SIGINT wait while a relaunch is submitted and recorded: the job and the
    ledger line naming it go together. A signal that came meanwhile is delivered after, to the
    handler that was in place (ours, Prefect's, or the default)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for number in previous:
        signal.signal(number, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in pending:
            signal.raise_signal(number)


def _signal_name(error: BaseException) -> str:
    number = getattr(error, "signum", None) or getattr(error, "signal", None)
    if isinstance(number, int):
        return signal.Signals(number).name
    return "SIGINT" if isinstance(error, KeyboardInterrupt) else type(error).__name__


# The states in which a relaunch can be adopted (watched to its resume): not one that ends.
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
        self.records = _records(profile)
        self.steps: Steps | None = None
        self.failed: Steps | None = None
        self.detected: Detected | None = None
        self.tri: Triage | None = None
        self.rules: list[Rule] = []

    def _save(self) -> None:
        try:
            record(self.save_dir, self.incident)
        except OSError as e:  # a full or read-only store: one line that says so
            raise CkptopsError(f"{ledger_path(self.save_dir)}: the incident cannot be written: {e}") from None

    def _do(self, name: str, fn, *args, **kwargs):
        """One phase: shown by ``step`` (a task in the UI, a line on a terminal)."""
        self.phase = name
        return self.step(name, fn, *args, **kwargs)

    def _stop(self, reason: str, outcome: str = STOPPED) -> None:
        self.incident.outcome, self.incident.reason = outcome, reason

    # The run as a whole.

    def run(self, started) -> Incident:
        incident = self.incident
        incident.mark("detected")
        try:
            self._triage()
        except CkptopsError as e:
            return self._closed(str(e))
        incident.failure_key = failure_key(self.source, self.tri, self.detected)
        try:
            lock = self._lock()
        except LockTimeout as e:
            return self._closed(f"another recovery of {incident.job} holds its recovery lock: {e}")
        with lock:
            try:
                adoptable = self._resolve_leftovers()
            except CkptopsError as e:
                return self._closed(str(e))
            if adoptable is not None:
                return self._adopt(adoptable, started)
            self._refuse_duplicate()
            incident.outcome, incident.owner = RUNNING, process.identity()
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
                    f"interrupted by {_signal_name(e)} during {self.phase}; {self._done()}", INTERRUPTED
                )
                e.incident = self.incident
            raise
        finally:
            if self.incident.outcome == RUNNING:
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
                        f"{_who(other.owner)}; nothing relaunched",
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
            if old.job != self.incident.job or old.outcome not in (RUNNING, INTERRUPTED):
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
                old.outcome, old.reason = INTERRUPTED, f"{_who(old.owner)} was killed; {ended}"
                record(self.save_dir, old)
        return adoptable

    def _refuse_duplicate(self) -> None:
        """A failure recovered once is not recovered again unless asked (``retry``): an approver's
        no stands. A recovery interrupted before it relaunched anything is simply taken up again,
        and one that relaunched is never repeated."""
        ours = self.incident.failure_key
        for other in read_ledger(self.save_dir).incidents:
            if other.failure_key != ours or (other.outcome == INTERRUPTED and not other.relaunched_job):
                continue
            if other.relaunched_job or not self.retry:
                raise Duplicate(
                    f"incident {other.id} already handled this failure ({ours}): {other.outcome}"
                    + (
                        f", relaunched {other.relaunched_job}"
                        if other.relaunched_job
                        else ", retry to recover it again"
                    )
                    + "; nothing relaunched",
                    other,
                )

    def _adopt(self, old: Incident, started) -> Incident:
        """Watch and validate the job a killed recovery relaunched, as that recovery would have."""
        note = f"adopted after {_who(old.owner)} ended; "
        self.incident = old
        old.outcome, old.owner = RUNNING, process.identity()
        self._save()

        def watch() -> None:
            steps = _read_records(self.records)
            before = old.records_before or 0
            self.failed = (
                _failed_attempt(steps.take(np.arange(min(before, len(steps)))), old.failed_job)
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
        incident.mark("triaged")
        incident.cls, incident.exit_code = tri.cls, tri.exit_code
        incident.first_error = tri.to_dict()["first_error"]
        incident.suspect_nodes = list(tri.suspect_nodes)
        if tri.first_error is not None and tri.first_error.at is not None:
            incident.mark("first_error", tri.first_error.at)

    def _phases(self) -> None:
        incident, settings = self.incident, self.settings
        self.steps = self._do("step-records", _read_records, self.records)
        self.failed = _failed_attempt(self.steps, self.source.slurm_job)
        if self.failed is not None:
            incident.failure_iteration = int(self.failed.iteration[-1])
            incident.mark("last_progress", float(self.failed.time[-1]))
        else:
            incident.failure_iteration = self.tri.iteration
        incident.promoted_at_failure, promotion = self._do("promote-pending", promote_pending, self.profile)
        incident.gpus = settings.gpus or self.profile.job.layout.world_size
        self._save()
        if self._rules_stop():
            return
        chosen, choices = self._choose()
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
        chosen = self._approval(chosen, choices, drained, exclude, admitted)
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
        )
        # Running incidents count too: the ledger has every incident from its start.
        history = [
            i for i in read_ledger(self.save_dir).incidents if i.job == incident.job and i.id != incident.id
        ]
        rules = self._do("stop-rules", stop_rules, failure, history, self.settings.max_per_hour)
        incident.rules = [r.to_dict() for r in rules]
        self.rules = rules
        if fired(rules):
            # A human decides from here: nothing is drained, chosen or relaunched.
            self._stop("stop rule: " + "; ".join(f"{r.name}: {r.detail}" for r in fired(rules)))
            incident.stop_rule = fired(rules)[0].name
            return True
        return False

    def _choose(self) -> tuple[int | None, list[int]]:
        """The checkpoint to resume from, verified again: one that no longer verifies is marked
        invalid (the pointer moves off it) and the next is chosen."""
        before = _anomaly(self.tri, self.steps) if self.tri.cls == "numerics" else None
        while True:
            failed = tuple(r["iteration"] for r in self.incident.reverified if r["outcome"] != "pass")
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

    def _approval(self, chosen, choices, drained, exclude, admitted) -> int | None:
        """The approver's decision; the checkpoint to relaunch from, or None (stopped)."""
        incident, settings = self.incident, self.settings
        relaunch = (
            " ".join(jobs.sbatch_command(settings, self._job_name(), chosen, exclude, self._log_dir()))
            if settings.launcher == "slurm"
            else f"bash {settings.script}"
        )
        plan = Plan(incident, self.tri, self.rules, chosen, choices, drained, exclude, admitted, relaunch)
        incident.mark("approval_requested")
        self._save()
        self.phase = "approval"
        if self.tri.cls in settings.auto_approve:
            decision = Decision(True, f"auto: {self.tri.cls} is in recovery.auto_approve")
        else:
            decision = self.approve(plan)
        if not decision.approve:
            note = f": {decision.note}" if decision.note else ""
            self._stop(f"not approved ({decision.by}){note}", ABORTED)
            return None
        incident.mark("approved")
        if decision.checkpoint is not None and decision.checkpoint != chosen:
            if decision.checkpoint not in choices:
                self._stop(f"checkpoint {decision.checkpoint} is not a verified candidate ({choices})")
                return None
            chosen = decision.checkpoint
            if not self._reverified(chosen):
                self._stop(f"checkpoint {chosen}, the approver's choice, failed re-verification")
                return None
        return chosen

    def _relaunch(self, chosen: int, exclude: list[str]) -> None:
        incident, settings = self.incident, self.settings
        incident.checkpoint = chosen
        if read_pointer(self.save_dir) != chosen:
            # A rollback (numerics, or the approver's pick) goes through the pointer, with a hold,
            # as an operator's would: the pointer stays the one record of what the job resumed from.
            self._do("roll-back-pointer", _roll_back, self.profile, chosen)
        running = self._do("already-running", self._running_copy)
        if running:
            raise CkptopsError(f"{running}: not relaunching a second copy")
        # The job is down: the records read at triage are all there are until the relaunch writes.
        incident.records_before = len(self.steps) if self.steps is not None else 0
        # The intent first; then the job and the line naming it, with signals held in between.
        incident.relaunch_token = incident.id
        self._save()
        with _signals_held():
            if settings.launcher == "slurm":
                new = self._do(
                    "relaunch",
                    jobs.submit,
                    settings,
                    self._job_name(),
                    chosen,
                    exclude,
                    self._log_dir(),
                    incident.relaunch_token,
                )
            else:
                new, incident.relaunch_process = self._do(
                    "relaunch",
                    jobs.start_local,
                    settings,
                    incident.job,
                    chosen,
                    self._log_dir(),
                    incident.relaunch_token,
                )
            incident.relaunched_job = new
            incident.mark("relaunch_submitted")
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
            if self.records is None:
                self._stop(
                    f"relaunched ({new}, {state}); no recovery.step_records to watch its progress or validate"
                )
                return
            progress = self._do(
                "wait-progress",
                jobs.wait_progress,
                new,
                self.records,
                incident.records_before or 0,
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
        now = load_steps(self.records)
        resumed = now.take(np.arange(incident.records_before or 0, len(now)))
        result = self._do(
            "validate-resume", validate_resume, checkpoint_dir, self.failed, resumed, self.profile.resume
        )
        incident.mark("validated")
        incident.validation = result.line()
        _account(incident, self.failed, checkpoint_dir)
        if result.ok:
            self._stop(f"resumed from {incident.checkpoint} as {new}; {result.line()}", COMPLETED)
        elif settings.on_rejected == "warn":
            self._stop(
                f"resume rejected, job left running (recovery.on_rejected: warn): {result.line()}", WARNED
            )
        else:
            self._stop(f"resume rejected, {jobs.cancel(new, holder)}: {result.line()}")


def recover(
    profile,
    source: Source,
    trigger: str,
    approve: Callable[[Plan], Decision],
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
    with _sigterm_ends_the_run():
        return _Recovery(profile, source, trigger, approve, step, flow_run, warn, retry).run(started)


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
    downtime = (t.get("first_resumed_step") or time.time()) - start if start is not None else 0.0
    incident.lost_gpu_hours = round(lost_gpu_hours(incident.gpus or 0, downtime, recomputed, step_seconds), 4)
