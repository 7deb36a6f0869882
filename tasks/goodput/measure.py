"""The goodput ledger: where a job's wall time went, measured from what the job and ckptops
already record, each figure with its source; a figure without a source is "not measured"
(None), never zero.

- productive time: the step time of the iterations on the surviving lineage (the last record of
  each iteration: steps recomputed after a resume count once, their first run is lost), from the
  step records or a Megatron-LM log;
- checkpoint saves, per save: the blocking time from Megatron-LM's ``save-checkpoint`` timer or
  the local job's ``saved checkpoint ... in Xs`` line (read by tasks.job.save_log), else the time
  the step loop was held (the gap between two step records less the step's own time); never the
  checkpoints' file times (tasks.goodput.snapshot picks the source);
- per incident, from the ledger: detection, triage and approval, queue and relaunch, load,
  recomputation, and the time lost to resumes that failed validation;
- wall time, ETTR = productive / wall, the incidents and the mean time between failures.
"""

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import numpy as np

from tasks.job.step_records import Steps
from tasks.recovery.ledger import Incident, IncidentOutcome

CAUSES = (
    "saves",
    "detection",
    "triage and approval",
    "queue and relaunch",
    # The relaunch's start: from running to its first step done, less one mean step (what the
    # step itself took is productive): the load, the set-up, the data loaders (Google's
    # goodput library's start-up badput).
    "start-up",
    "recomputation",
    "validation failures",
    # A recovery from a failure the infrastructure caused (a preemption): its downtime, first
    # error to first resumed step, apart from the job's own failures and its MTBF.
    "infrastructure",
)


@dataclass
class Figure:
    seconds: float | None
    source: str

    @property
    def measured(self) -> bool:
        return self.seconds is not None


@dataclass
class Untrained:
    """What relaunches past data failures (--iterations-to-skip) left untrained: not time lost,
    but data the run will not have seen."""

    iterations: list[int] = field(default_factory=list)
    tokens: int | None = None  # None where a skip's token count is not known (a batch ramp-up)
    source: str = "no data skipped"


@dataclass
class GoodputLedger:
    """What the job's time went to (not the recovery's incident ledger, tasks.recovery.ledger)."""

    job: str
    since: str | None
    wall: Figure
    productive: Figure
    lost: dict[str, Figure]
    ettr: float | None
    incidents: int
    mtbf: Figure
    save_seconds: Figure  # the median blocking save, for the advice
    restart_seconds: Figure  # the median downtime of a recovery (first error to first resumed step)
    saves: list[float] = field(default_factory=list)
    per_day: list[dict] = field(default_factory=list)
    interval: Figure = field(default_factory=lambda: Figure(None, "not measured"))  # the job's own
    untrained: Untrained = field(default_factory=Untrained)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["ettr_source"] = "productive / wall" if self.ettr is not None else "not measured"
        return data


def _median(values) -> float | None:
    values = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.median(values)) if values else None


def save_times_from_records(steps: Steps, save_interval: int | None) -> list[float]:
    """The time the step loop was held after each save iteration: the gap to the next record
    less that step's own time."""
    if save_interval is None or len(steps) < 2 or not np.isfinite(steps.time).all():
        return []
    it, t, step = steps.iteration, steps.time, steps.step_seconds
    held = []
    for i in range(len(steps) - 1):
        if it[i] % save_interval == 0 and it[i + 1] == it[i] + 1:
            held.append(max(0.0, float(t[i + 1] - t[i] - step[i + 1])))
    return held


def _lineage(steps: Steps) -> np.ndarray:
    """Rows of the surviving lineage: the last record of each iteration."""
    reversed_its = steps.iteration[::-1]
    _, first = np.unique(reversed_its, return_index=True)
    return np.sort(len(steps) - 1 - first)


def _span(incident: Incident, start: str, end: str) -> float | None:
    t = incident.times
    a, b = t.get(start), t.get(end)
    return b - a if a is not None and b is not None and b >= a else None


def _start_up(incident: Incident, step_seconds: float | None) -> float | None:
    span = _span(incident, "job_running", "first_resumed_step")
    return None if span is None else max(0.0, span - (step_seconds or 0.0))


def incident_losses(incident: Incident, step_seconds: float | None) -> dict[str, float | None]:
    """Seconds lost to each cause in one incident (None where the ledger does not say)."""
    onset = "first_error" if "first_error" in incident.times else "last_progress"
    recomputed = (
        incident.recomputed_iterations * step_seconds
        if incident.recomputed_iterations is not None and step_seconds is not None
        else None
    )
    if incident.infrastructure:
        lost: dict[str, float | None] = dict.fromkeys(CAUSES[1:], 0.0)
        lost["infrastructure"] = _span(incident, onset, "first_resumed_step")
        return lost
    failed_validation = incident.validation is not None and incident.outcome != IncidentOutcome.COMPLETED
    return {
        "detection": _span(incident, onset, "detected"),
        "triage and approval": _span(incident, "detected", "approved"),
        "queue and relaunch": _span(incident, "approved", "job_running"),
        "start-up": _start_up(incident, step_seconds),
        "recomputation": recomputed,
        "validation failures": _span(incident, "first_resumed_step", "validated")
        if failed_validation
        else 0.0,
        "infrastructure": 0.0,
    }


def measure(
    job: str,
    steps: Steps | None,
    incidents: list[Incident],
    save_times: tuple[list[float], str],
    since: float | None = None,
    interval: Figure | None = None,
) -> GoodputLedger:
    """The ledger from the job's records (or log), its incidents and its save times."""
    since_text = datetime.fromtimestamp(since, UTC).isoformat() if since else None
    if since is not None:
        incidents = [i for i in incidents if i.times.get("detected", 0) >= since]
    productive = wall = Figure(None, "not measured: no step records or log")
    step_seconds = None
    per_day: list[dict] = []
    if steps is not None and len(steps):
        rows = np.arange(len(steps))
        if since is not None and np.isfinite(steps.time).any():
            rows = rows[steps.time[rows] >= since]
        if rows.size:
            picked = steps.take(rows)
            keep = _lineage(picked)
            productive = Figure(float(np.nansum(picked.step_seconds[keep])), f"step times, {picked.source}")
            step_seconds = _median(picked.step_seconds)
            times = picked.time[np.isfinite(picked.time)]
            if times.size:
                first = float(
                    times.min() - (picked.step_seconds[0] if np.isfinite(picked.step_seconds[0]) else 0)
                )
                what = "iteration line" if picked.kind == "megatron-log" else "step record"
                wall = Figure(float(times.max()) - first, f"first to last {what}, {picked.source}")
                per_day = _per_day(picked, keep, incidents, step_seconds)
            else:
                wall = Figure(None, "not measured: the log's iteration lines carry no times")
    saves, save_source = save_times
    unmeasured = Figure(None, f"not measured: {save_source}")
    lost = {"saves": Figure(sum(saves), save_source) if saves else unmeasured}
    spans = [incident_losses(i, step_seconds) for i in incidents]
    for cause in CAUSES[1:]:
        values = [s[cause] for s in spans if s[cause] is not None]
        lost[cause] = (
            Figure(float(sum(values)), f"incident ledger ({len(values)} of {len(incidents)} incidents)")
            if values
            else Figure(None, "not measured: no incident says" if incidents else "no incidents")
        )
    ettr = (
        productive.seconds / wall.seconds
        if productive.measured and wall.measured and wall.seconds > 0
        else None
    )
    own = [i for i in incidents if not i.infrastructure]
    apart = f" ({len(incidents) - len(own)} the infrastructure's apart)" if len(own) < len(incidents) else ""
    mtbf = (
        Figure(wall.seconds / len(own), f"wall time / {len(own)} incidents{apart}")
        if wall.measured and own
        else Figure(None, "not measured: no incidents" if wall.measured else "not measured: no wall time")
    )
    downtimes = [
        _span(i, "first_error" if "first_error" in i.times else "detected", "first_resumed_step")
        for i in incidents
    ]
    restart = _median(downtimes)
    return GoodputLedger(
        job,
        since_text,
        wall,
        productive,
        lost,
        ettr,
        len(incidents),
        mtbf,
        Figure(_median(saves), save_source) if saves else unmeasured,
        Figure(restart, "median first error to first resumed step, incident ledger")
        if restart is not None
        else Figure(None, "not measured: no recovered incident"),
        saves,
        per_day,
        interval or Figure(None, "not measured"),
        _untrained(incidents),
    )


def _untrained(incidents: list[Incident]) -> Untrained:
    """What the job's relaunches skipped, from the incidents that relaunched past a window."""
    skips = [i.skipped for i in incidents if i.skipped and i.skipped["confirmed"] and i.relaunched_job]
    if not skips:
        return Untrained()
    # An iteration skipped again by a later relaunch (from an older checkpoint) counts once.
    per_iteration: dict[int, float | None] = {}
    for s in skips:
        share = None if s["tokens"] is None else s["tokens"] / len(s["iterations"])
        for it in s["iterations"]:
            if per_iteration.get(it) is None:  # the first count known for it
                per_iteration[it] = share
    unknown = [it for it, tokens in per_iteration.items() if tokens is None]
    return Untrained(
        sorted(per_iteration),
        None if unknown else int(sum(per_iteration.values())),
        f"incident ledger ({len(skips)} relaunches past a data failure"
        + (f"; iterations {', '.join(map(str, sorted(unknown)))} without a token count" if unknown else "")
        + ")",
    )


def _per_day(
    steps: Steps, keep: np.ndarray, incidents: list[Incident], step_seconds: float | None
) -> list[dict]:
    """Hours per UTC day: productive, and lost per cause (incidents by the day detected)."""
    days: dict[str, dict] = {}

    def day(ts: float) -> dict:
        key = datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d")
        return days.setdefault(key, {"day": key, "productive": 0.0, **{c: 0.0 for c in CAUSES[1:]}})

    for row in keep:
        if np.isfinite(steps.time[row]) and np.isfinite(steps.step_seconds[row]):
            day(float(steps.time[row]))["productive"] += float(steps.step_seconds[row]) / 3600
    for incident in incidents:
        if "detected" not in incident.times:
            continue
        bucket = day(incident.times["detected"])
        for cause, seconds in incident_losses(incident, step_seconds).items():
            bucket[cause] += (seconds or 0.0) / 3600
    return [days[k] for k in sorted(days)]
