"""The incident ledger: JSON lines in ``<save_dir>/.ckptops-history/incidents.jsonl``.

The ledger is the job's memory of its failures: the stop rules read it (tasks.recovery.rules),
``ckptops incidents`` and the UI show it, and goodput is measured from it. It lives beside the
checkpoints it talks about, so it survives a Prefect database reset.

An incident is written when its recovery starts (outcome ``running``, with the failure's
identity) and again each time a phase ends: every write is one appended line holding the whole
incident (one O_APPEND write, fsynced), and the newest line of an id is the incident. So a
recovery killed at any instruction leaves its incident, as far as it got, for the next one to
find. Every line is type-checked when read; one that is not an incident is reported (file, line,
field) and skipped, never used.
"""

import json
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TypedDict

import pydantic

from tasks.checkpoint.layout import HISTORY
from tasks.errors import unreadable
from tasks.recovery.triage.model import FailureClass
from tasks.storage.local import append_jsonl, clip, own_folder, read_lines

INCIDENTS = "incidents.jsonl"

# The phases of an incident, in the order they happen; each is an epoch time in ``times``.
PHASES = (
    "last_progress",
    "first_error",
    "detected",
    "triaged",
    "reverified",
    "health_done",
    "approval_requested",
    "approved",
    "relaunch_submitted",
    "job_running",
    "first_resumed_step",
    "validated",
)


class IncidentOutcome(StrEnum):
    """How an incident ended (or that it has not yet)."""

    RUNNING = "running"  # its recovery is at work (or was killed: the next recovery resolves it)
    COMPLETED = "completed"  # relaunched and the resume validated
    WARNED = "warned"  # relaunched; validation rejected it but the profile only warns
    STOPPED = "stopped"  # a human must act: a stop rule, no checkpoint, a failed relaunch, a rejected resume
    ABORTED = "aborted"  # the approver said no, or nobody answered in time
    INTERRUPTED = "interrupted"  # its recovery was ended by a signal (or killed) before it finished


# Text fields are kept to this many characters (a first error of 200 MB is not kept whole).
TEXT_LIMIT = 4096
# A ledger line longer than this is not one ckptops wrote: it is reported, never parsed.
LINE_LIMIT = 1 << 20


def new_id(now: float | None = None) -> str:
    """A short incident id that sorts by time: ``20261201-0412-3f9a``."""
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{uuid.uuid4().hex[:4]}"


class FirstError(TypedDict):
    file: str
    line: int
    text: str


class RuleVerdict(TypedDict):
    name: str
    fired: bool
    detail: str


class Holder(TypedDict):
    """A process (tasks.cluster.process.identity)."""

    host: str
    pid: int
    started: float


class Reverified(TypedDict):
    iteration: int
    mode: str
    engine: str | None
    outcome: str
    state: str
    reason: str
    seconds: float
    bytes: int
    pointer: int | None


class Skipped(TypedDict):
    """The training data a relaunch was told to pass (a ``data`` failure's window): never trained."""

    iterations: list[int]
    samples: list[int] | None  # [first, end) in the data order; None where not one range, or ramped
    tokens: int | None
    # Megatron-LM printed these iterations in its iterations_to_skip: the skip took effect (False:
    # planned, or the relaunch was stopped before it trained)
    confirmed: bool


@dataclass
class Incident:
    # Ledger lines are read strictly: a "7" is not an exit code, true is not a GPU count.
    __pydantic_config__ = pydantic.ConfigDict(strict=True, allow_inf_nan=False)

    id: str
    job: str
    trigger: str  # "manual", "event" or "cli"
    failed_job: str | None = None  # the Slurm job id, or the log paths' first file
    times: dict[str, float] = field(default_factory=dict)
    cls: FailureClass | None = None
    exit_code: int | None = None
    first_error: FirstError | None = None
    suspect_nodes: list[str] = field(default_factory=list)
    suspect_gpus: list[str] = field(default_factory=list)  # node:device, where the rerun machine says
    drained: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    health: str | None = None  # the suspects' health verdicts
    # For a hang, what the ranks' Flight Recorder dumps showed: the collective the others wait in
    # and the ranks that never entered it (or why no dump could be read).
    hang: str | None = None
    # The scheduler or the cloud took the nodes away (triage's line): counted against no budget.
    infrastructure: str | None = None
    promoted_at_failure: int | None = None  # the pointer when the failure was triaged
    checkpoint: int | None = None  # the iteration relaunched from
    # A numerical failure soon after the last relaunch loaded its checkpoint: this recovery fell
    # back to the verified checkpoint before that one (``fallback_from``), and says why.
    fallback_from: int | None = None
    fallback: str | None = None
    failure_iteration: int | None = None
    # A data failure's window, relaunched past with --iterations-to-skip (what was not trained).
    skipped: Skipped | None = None
    recomputed_iterations: int | None = None
    recomputed_tokens: int | None = None
    lost_gpu_hours: float | None = None
    gpus: int | None = None
    rules: list[RuleVerdict] = field(default_factory=list)
    stop_rule: str | None = None
    relaunched_job: str | None = None
    validation: str | None = None
    outcome: IncidentOutcome | None = None
    reason: str | None = None
    flow_run: str | None = None
    # What failed, as one key: the Slurm job and its exit, or the logs' first error. A second
    # recovery of the same failure finds the first by it.
    failure_key: str | None = None
    owner: Holder | None = None  # the recovery's process
    records_before: int | None = None  # step records there were when the relaunch was submitted
    # Saved before the relaunch is submitted, and given to the job (its Slurm comment, a local
    # job's environment), so a recovery killed between the submission and the next save leaves
    # a relaunch the next recovery can still find.
    relaunch_token: str | None = None
    relaunch_process: Holder | None = None  # a local relaunch's process
    reverified: list[Reverified] = field(default_factory=list)  # each re-verification before relaunch
    # The relaunch script's Megatron-LM flags against the checkpoint's args (tasks.relaunch.fit):
    # its summary, then each difference as "<kind>: <words>".
    relaunch_args: list[str] = field(default_factory=list)
    # The argument names whose differences a person approved (the pre-check's ``approve`` ones).
    approved_args: list[str] = field(default_factory=list)
    relaunch_log: str | None = None  # the relaunched job's own output (a local relaunch's file)
    # Its size when the relaunch was submitted: a Slurm output kept across runs (a fixed
    # --output in --open-mode=append, a requeue) holds the failed run's lines before it.
    relaunch_log_offset: int = 0
    # Megatron-LM's own printed arguments in that output against the checkpoint's: where they
    # were read, the summary, then each difference as "<kind>: <words>".
    printed_args: list[str] = field(default_factory=list)
    # Where the relaunch's steps were read and validated: the job's step records, or its output.
    watched: str | None = None

    def mark(self, phase: str, at: float | None = None) -> None:
        """``phase`` happened at ``at`` (now, if None); a time that is not a number (a NaN from
        a log without times) leaves the phase unmeasured rather than wrong."""
        assert phase in PHASES, phase
        if at is None:
            at = time.time()
        if math.isfinite(at):
            self.times[phase] = float(at)

    @property
    def running(self) -> bool:
        return self.outcome == IncidentOutcome.RUNNING

    def to_dict(self) -> dict:
        """The incident as a ledger line: strict JSON (a figure that is not a number is null),
        text fields bounded."""
        data = _finite(asdict(self))
        data["class"] = data.pop("cls")
        for name in ("reason", "health", "validation"):
            if isinstance(data[name], str):
                data[name] = clip(data[name], TEXT_LIMIT)
        first = data["first_error"]
        if isinstance(first, dict) and isinstance(first.get("text"), str):
            data["first_error"] = {**first, "text": clip(first["text"], TEXT_LIMIT)}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Incident":
        """An incident from a ledger line, every field's type checked strictly (``pydantic``, as
        JSON: no NaN, no infinity, no number as a string); fields another version of ckptops
        wrote that this one does not know are left out."""
        data = dict(data)
        data["cls"] = data.pop("class", None)
        known = cls.__dataclass_fields__
        return _INCIDENT.validate_json(json.dumps({k: v for k, v in data.items() if k in known}))


_INCIDENT = pydantic.TypeAdapter(Incident)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


@dataclass
class Ledger:
    """The incidents (the newest line of each, in the order they began) and the lines that
    could not be used, one line each naming the file, the line number and the field."""

    incidents: list[Incident]
    problems: list[str]


def ledger_path(save_dir: Path) -> Path:
    return Path(save_dir) / HISTORY / INCIDENTS


def record(save_dir: Path, incident: Incident) -> None:
    """Append the incident as it is now (its newest line is what readers see)."""
    append_jsonl(own_folder(save_dir, HISTORY) / INCIDENTS, incident.to_dict())


def _problem(error: pydantic.ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join("class" if part == "cls" else str(part) for part in first["loc"]) or "(the line)"
    return f"{where}: {first['msg']}"


def read_ledger(save_dir: Path) -> Ledger:
    """Every incident in the ledger; torn, foreign or wrongly typed lines are reported, skipped."""
    path = ledger_path(save_dir)
    if not path.exists():
        return Ledger([], [])
    found: dict[str, Incident] = {}
    problems: list[str] = []
    try:
        for number, text in enumerate(read_lines(path, LINE_LIMIT), 1):
            if not text.strip():
                continue
            if len(text) >= LINE_LIMIT:
                problems.append(f"{path}:{number}: longer than {LINE_LIMIT} bytes; skipped")
                continue
            try:
                entry = json.loads(text, parse_constant=_no_constant)
            except ValueError as e:
                problems.append(f"{path}:{number}: not JSON ({e}); skipped")
                continue
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                problems.append(f"{path}:{number}: not an incident (no id); skipped")
                continue
            try:
                incident = Incident.from_dict(entry)
            except pydantic.ValidationError as e:
                problems.append(f"{path}:{number}: {_problem(e)}; skipped")
                continue
            found[incident.id] = incident  # a later line of an id replaces it in its place
    except OSError as e:
        raise unreadable(path, e) from None
    return Ledger(list(found.values()), problems)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def incidents(save_dir: Path) -> list[Incident]:
    """Every recorded incident, in the order they began (unusable lines skipped)."""
    return read_ledger(save_dir).incidents


def lost_gpu_hours(
    gpus: int, downtime_seconds: float, recomputed_iterations: int, step_seconds: float
) -> float:
    """GPU time the failure cost: every GPU idle while the job was down, plus the work redone
    from the checkpoint up to where the failure struck."""
    downtime = downtime_seconds if math.isfinite(downtime_seconds) else 0.0
    step = step_seconds if math.isfinite(step_seconds) else 0.0
    return gpus * (max(0.0, downtime) + max(0, recomputed_iterations) * step) / 3600
