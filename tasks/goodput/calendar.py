"""The calendar: when the job reaches its target token count, from what it measured.

- tokens so far: the last step's consumed samples x the sequence length (checkpoint args), else
  (step records, which carry tokens/s) tokens/s x step time summed over the surviving lineage;
- steady-state tokens/s: the median of the last WINDOW_STEPS steps (records, or log lines) that
  are not among the first WARMUP_STEPS of a run: warm-up, and each restart (a new attempt, an
  iteration at or below the one before it, a newly loaded checkpoint) starts a run; a log gives
  samples/s, turned into tokens/s with the checkpoint's sequence length;
- ETTR: the goodput ledger's productive / wall (the incidents' downtime and the saves are in the
  wall time); where the ledger has no wall time, 1.0, and the calendar says it was assumed;
- the projected end: start + (target - tokens so far) / tokens/s / ETTR; the same at the advised
  checkpoint interval, with the measured ETTR moved by the gain the advice predicts
  (ETTR at Daly's interval less ETTR at the job's own, tasks.goodput.advice);
- day by day (UTC): the projection as it stood at the end of each day the steps cover, from the
  steps up to then.
"""

import math
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import numpy as np

from tasks.errors import UsageError
from tasks.goodput.measure import GoodputLedger, _lineage
from tasks.goodput.report import advice, ledger
from tasks.goodput.snapshot import JobSnapshot
from tasks.job.step_records import Steps

# The first steps of each run are warm-up (compilation, allocator, data loader): left out.
WARMUP_STEPS = 10
# The steady state is the median over this many of the last steps past warm-up.
WINDOW_STEPS = 100
DAY = 86400.0
# The last moment a date can name (datetime's 9999-12-31 23:59:59 UTC).
LAST_DATE = 253402300799.0


def rate(tokens_per_second: float) -> str:
    """Tokens/s as a person reads them: whole numbers, three figures below 100."""
    return f"{tokens_per_second:,.0f}" if tokens_per_second >= 100 else f"{tokens_per_second:.3g}"


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def _days(days: float) -> str:
    """A span given in days, in the unit that shows it: days, hours or minutes."""
    if days >= 1:
        return f"{days:.2f} days"
    return f"{days * 24:.1f} hours" if days * 24 >= 1 else f"{days * 1440:.1f} minutes"


@dataclass
class Projection:
    ettr: float
    compute_days: float  # the remaining tokens at the steady tokens/s, every second productive
    wall_days: float  # compute_days / ETTR
    end: str  # UTC, ISO 8601
    end_ts: float


def project(
    tokens_done: float, tokens_per_second: float, ettr: float, target: float, start: float
) -> Projection:
    """The projected end: ``start`` + (target - tokens_done) / tokens_per_second / ettr."""
    for name, value in (("target tokens", target), ("tokens/s", tokens_per_second)):
        if not math.isfinite(value) or value <= 0:
            raise UsageError(f"{name}: must be a positive number, got {value}")
    if not math.isfinite(tokens_done) or tokens_done < 0:
        raise UsageError(f"tokens so far: must be a finite number, not negative, got {tokens_done}")
    if not math.isfinite(ettr) or not 0 < ettr <= 1:
        raise UsageError(f"ETTR: must be above 0 and at most 1, got {ettr}")
    if tokens_done >= target:
        raise UsageError(f"the target is reached: {tokens_done:,.0f} tokens so far, target {target:,.0f}")
    compute = (target - tokens_done) / tokens_per_second
    end = start + compute / ettr
    if end >= LAST_DATE:
        raise UsageError(
            f"the projected end is past the year 9999: {compute / ettr / DAY:,.0f} days at "
            f"{rate(tokens_per_second)} tokens/s"
        )
    return Projection(ettr, compute / DAY, compute / ettr / DAY, iso(end), end)


def run_position(steps: Steps) -> np.ndarray:
    """Each row's place in its run (0 for a run's first step): a run starts at the first row, a
    new attempt (records), an iteration at or below the one before it, a newly loaded
    checkpoint (Megatron-LM's log says which)."""
    n = len(steps)
    new = np.zeros(n, dtype=bool)
    if not n:
        return np.zeros(0, dtype=np.int64)
    new[0] = True
    it = steps.iteration
    new[1:] |= it[1:] <= it[:-1]
    if steps.attempt.size == n:
        new[1:] |= steps.attempt[1:] != steps.attempt[:-1]
    if "loaded" in steps.columns:
        loaded = steps.loaded
        same = (loaded[1:] == loaded[:-1]) | (np.isnan(loaded[1:]) & np.isnan(loaded[:-1]))
        new[1:] |= ~same
    rows = np.arange(n)
    return rows - np.maximum.accumulate(np.where(new, rows, 0))


def tokens_per_second_column(steps: Steps, seq_length: int | None) -> np.ndarray:
    if steps.throughput_unit == "tokens/s":
        return steps.throughput
    if seq_length:
        return steps.throughput * seq_length
    raise UsageError(
        f"{steps.source}: the log gives samples/s and no checkpoint says the sequence length; "
        "give --tokens-per-second"
    )


def steady_throughput(
    steps: Steps, seq_length: int | None, rows: np.ndarray | None = None
) -> tuple[float, str]:
    """The median tokens/s of the last WINDOW_STEPS of ``rows`` past each run's warm-up."""
    rows = np.arange(len(steps)) if rows is None else rows
    tps = tokens_per_second_column(steps, seq_length)
    past = rows[run_position(steps)[rows] >= WARMUP_STEPS]
    past = past[np.isfinite(tps[past]) & (tps[past] > 0)]
    if not past.size:
        raise UsageError(
            f"{steps.source}: no step with a throughput past the first {WARMUP_STEPS} of its run "
            "(warm-up); give --tokens-per-second"
        )
    window = past[-WINDOW_STEPS:]
    unit = "" if steps.throughput_unit == "tokens/s" else f" (samples/s x sequence length {seq_length})"
    first, last = int(steps.iteration[window[0]]), int(steps.iteration[window[-1]])
    return float(np.median(tps[window])), (
        f"median of {window.size} steps (iterations {first}-{last}) past the first {WARMUP_STEPS} "
        f"of each run{unit}, {steps.source}"
    )


def tokens_done(steps: Steps, seq_length: int | None, rows: np.ndarray | None = None) -> tuple[float, str]:
    rows = np.arange(len(steps)) if rows is None else rows
    consumed = steps.consumed[rows]
    finite = consumed[np.isfinite(consumed)]
    if seq_length and finite.size:
        return float(finite[-1]) * seq_length, (
            f"consumed samples {finite[-1]:,.0f} x sequence length {seq_length} (checkpoint args), "
            f"{steps.source}"
        )
    if steps.throughput_unit == "tokens/s" and rows.size:
        picked = steps.take(rows)
        keep = _lineage(picked)
        tokens = picked.throughput[keep] * picked.step_seconds[keep]
        if np.isfinite(tokens).any():
            return float(
                np.nansum(tokens)
            ), f"tokens/s x step time over the surviving lineage, {steps.source}"
    raise UsageError(
        f"{steps.source}: no tokens so far in it (no consumed samples with a sequence length, "
        "no tokens/s); give --tokens-done"
    )


def ettr_until(steps: Steps, rows: np.ndarray) -> float | None:
    """Productive / wall over these rows, as the goodput ledger computes it (tasks.goodput.measure)."""
    if not rows.size:
        return None
    picked = steps.take(rows)
    productive = float(np.nansum(picked.step_seconds[_lineage(picked)]))
    times = picked.time[np.isfinite(picked.time)]
    if not times.size:
        return None
    first_step = picked.step_seconds[0]
    wall = float(times.max()) - float(times.min() - (first_step if np.isfinite(first_step) else 0))
    return productive / wall if wall > 0 else None


def daily(steps: Steps, seq_length: int | None, target: float, ettr: float | None = None) -> list[dict]:
    """The projection at the end of each UTC day the steps cover (the last day: at its last
    step), from the steps up to then; ``ettr`` (given) instead of each day's measured one."""
    times = steps.time
    finite = np.isfinite(times)
    if not finite.any():
        return []
    found = []
    last = float(times[finite].max())
    day = datetime.fromtimestamp(float(times[finite].min()), UTC).replace(
        hour=0, minute=0, second=0, microsecond=0
    )
    while day.timestamp() <= last:
        cutoff = min(day.timestamp() + DAY, last)
        rows = np.nonzero(finite & (times <= cutoff))[0]
        entry = {"day": day.strftime("%Y-%m-%d"), "at": iso(cutoff)}
        day = datetime.fromtimestamp(day.timestamp() + DAY, UTC)
        try:
            done, _ = tokens_done(steps, seq_length, rows)
            tps, _ = steady_throughput(steps, seq_length, rows)
        except UsageError as e:
            found.append({**entry, "end": None, "note": str(e)})
            continue
        measured = ettr if ettr is not None else ettr_until(steps, rows)
        ratio = measured if measured is not None and measured > 0 else 1.0
        entry.update(tokens_done=done, tokens_per_second=tps, ettr=ratio)
        if done >= target:
            found.append({**entry, "end": None, "note": "target reached"})
            continue
        try:
            end = project(done, tps, min(ratio, 1.0), target, cutoff)
        except UsageError as e:
            found.append({**entry, "end": None, "note": str(e)})
            continue
        found.append({**entry, "end": end.end, "end_ts": end.end_ts})
    return found


@dataclass
class Calendar:
    job: str
    target_tokens: float
    tokens_done: float
    tokens_source: str
    tokens_per_second: float
    throughput_source: str
    ettr_source: str
    start: str
    projection: Projection
    advised: Projection | None
    advised_note: str
    days: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        p = self.projection
        lines = [
            f"calendar of {self.job}: {self.target_tokens:,.0f} tokens, projected from {self.start}",
            f"  tokens so far: {self.tokens_done:,.0f} ({self.tokens_done / self.target_tokens:.2%} of the "
            f"target; {self.tokens_source})",
            f"  steady-state throughput: {rate(self.tokens_per_second)} tokens/s ({self.throughput_source})",
            f"  remaining: {self.target_tokens - self.tokens_done:,.0f} tokens, "
            f"{_days(p.compute_days)} of compute",
            f"  ETTR {p.ettr:.2%} ({self.ettr_source}): {_days(p.wall_days)}; projected end {p.end}",
        ]
        if self.advised is not None:
            a = self.advised
            sooner = (p.end_ts - a.end_ts) / DAY
            which = "sooner" if sooner >= 0 else "later"
            lines.append(
                f"  at the advised interval: ETTR {a.ettr:.2%} ({self.advised_note}): "
                f"{_days(a.wall_days)}; projected end {a.end} ({abs(sooner):.2f} days {which})"
            )
        else:
            lines.append(f"  at the advised interval: {self.advised_note}")
        return lines


def _measured(job: JobSnapshot, done: float | None, tps: float | None) -> tuple[float, str, float, str]:
    """Tokens so far and the steady tokens/s, each given, else measured from the job's steps."""
    if job.steps is None and (done is None or tps is None):
        where = f"{job.log}" if job.log else "recovery.step_records"
        raise UsageError(
            f"no step records or log to measure from ({where}); "
            "give --log, or --tokens-done and --tokens-per-second"
        )
    done, tokens_source = (done, "given") if done is not None else tokens_done(job.steps, job.seq_length)
    tps, throughput_source = (
        (tps, "given") if tps is not None else steady_throughput(job.steps, job.seq_length)
    )
    return done, tokens_source, tps, throughput_source


def _ettr(ettr: float | None, found: GoodputLedger) -> tuple[float, str]:
    """ETTR given, else the ledger's productive / wall, else 1.0 (assumed, and said so)."""
    if ettr is not None:
        return ettr, "given"
    if found.ettr is not None and found.ettr > 0:
        return min(found.ettr, 1.0), f"productive / wall, goodput ledger, {found.incidents} incidents"
    return 1.0, f"assumed 1.0: the ledger has none ({found.wall.source})"


def _advised_ettr(
    job: JobSnapshot, found: GoodputLedger, advice_inputs: dict, ratio: float
) -> tuple[float | None, str]:
    """The ETTR at Daly's interval: the measured one moved by the gain the advice predicts; or
    None, and why not."""
    try:
        adv = advice(job, found, **advice_inputs)
    except UsageError as e:
        return None, f"no advice: {e}"
    if adv.ettr_now is None:
        return None, "the job's current interval is not measured; give --interval-minutes"
    gain = adv.ettr_advised - adv.ettr_now
    moved = min(1.0, ratio + gain)
    if moved <= 0:
        return None, f"ETTR {ratio:.2%} {gain:+.2%} at Daly's interval: no progress"
    return moved, (
        f"Daly's {adv.daly_minutes:.1f} min instead of {adv.interval_seconds / 60:.1f} min: "
        f"{gain * 100:+.2f} points, as the advice predicts"
    )


def calendar(
    job: JobSnapshot,
    target: float,
    start: float | None = None,
    done: float | None = None,
    tps: float | None = None,
    ettr: float | None = None,
    advice_inputs: dict | None = None,
) -> Calendar:
    """The calendar of the job: each of tokens so far, tokens/s and ETTR given, else measured (its
    steps, the goodput ledger); the advice from the ledger with ``advice_inputs`` (report.advice's
    save, mtbf_hours, restart_minutes, interval_minutes)."""
    if not math.isfinite(target) or target <= 0:
        raise UsageError(f"--target-tokens: must be a positive number, got {target}")
    start = time.time() if start is None else start
    done, tokens_source, tps, throughput_source = _measured(job, done, tps)
    found = ledger(job)
    ratio, ettr_source = _ettr(ettr, found)
    now = project(done, tps, ratio, target, start)
    moved, note = _advised_ettr(job, found, advice_inputs or {}, ratio)
    return Calendar(
        job.name,
        float(target),
        float(done),
        tokens_source,
        float(tps),
        throughput_source,
        ettr_source,
        iso(start),
        now,
        None if moved is None else project(done, tps, moved, target, start),
        note,
        daily(job.steps, job.seq_length, target, ettr) if job.steps is not None else [],
    )


def end_date_png(found: Calendar) -> bytes:
    """The projected end date as it stood at the end of each day."""
    from tasks.plots import png, pyplot

    plt = pyplot()
    points = [(d["day"], d["end"]) for d in found.days if d.get("end")]
    fig, ax = plt.subplots(figsize=(9, 3.5), dpi=100)
    days = [datetime.fromisoformat(day).replace(tzinfo=UTC) for day, _ in points]
    ends = [datetime.fromisoformat(end) for _, end in points]
    ax.plot(days, ends, marker="o")
    ax.set_xlabel("day (UTC)")
    ax.set_ylabel("projected end (UTC)")
    ax.set_title(f"{found.job}: projected end of {found.target_tokens:,.0f} tokens, day by day")
    fig.autofmt_xdate()
    return png(fig)


def markdown(found: Calendar) -> str:
    from tasks.plots import markdown_image

    parts = [f"# calendar: {found.job}", "", *(f"- {line.strip()}" for line in found.lines()[1:])]
    if any(d.get("end") for d in found.days):
        parts += ["", markdown_image("projected end date by day", end_date_png(found))]
    return "\n".join(parts)
