"""A discrete-event simulation of a training job's wall clock: exponential failures, periodic
saves (synchronous, or asynchronous where only the blocking part holds training and the
checkpoint counts once persisted), the work lost since the last persisted checkpoint, and the
restart after each failure. ETTR is the work on the surviving lineage over the wall time;
repeated runs give its confidence interval.

All times in seconds. Failures do not strike during a restart (as in the closed forms).
"""

import math
from dataclasses import asdict, dataclass

import numpy as np

from tasks.errors import UsageError
from tasks.goodput.advice import check_gpus, daly, ettr, not_negative, positive

Z95 = 1.96
# Bounds: a simulation runs about 30,000 events a second here, so the largest takes minutes.
MAX_DAYS = 3650
MAX_RUNS = 100_000
MAX_EVENTS = 5_000_000


@dataclass
class Simulation:
    gpus: int
    days: float
    mtbf_seconds: float
    save_seconds: float
    blocking_seconds: float
    interval_seconds: float
    restart_seconds: float
    runs: int
    seed: int
    ettr: float
    ettr_ci: tuple[float, float]
    failures_per_run: float
    gpu_hours_lost: float  # per run, mean

    def to_dict(self) -> dict:
        return asdict(self)


def _one(rng, horizon, mtbf, save, blocking, interval, restart) -> tuple[float, int]:
    """One run: (work kept, failures)."""
    t, work, persisted = 0.0, 0.0, 0.0
    since_save = 0.0
    pending: tuple[float, float] | None = None  # (persisted at, work it holds)
    failure = rng.exponential(mtbf)
    failures = 0
    while t < horizon:
        save_at = t + (interval - since_save)
        upcoming = min(save_at, failure, horizon, pending[0] if pending else math.inf)
        work += upcoming - t
        since_save += upcoming - t
        t = upcoming
        if pending and t >= pending[0] and t < failure:
            persisted, pending = pending[1], None
            continue
        if t >= horizon:
            break
        if t >= failure:
            failures += 1
            work, since_save, pending = persisted, 0.0, None
            t += restart
            failure = t + rng.exponential(mtbf)
            continue
        # A save: training is held for the blocking part; the checkpoint persists after ``save``.
        if t + blocking > failure:
            t = failure  # the save did not finish: the failure is handled next turn
            continue
        pending = (t + save, work)
        t += blocking
        since_save = 0.0
        if pending[0] <= t:
            persisted, pending = pending[1], None
    return work, failures


def _check(gpus, days, mtbf, save, interval, restart, seed, runs) -> None:
    """Every input finite and in range, and the whole simulation within MAX_EVENTS: one line
    naming the value otherwise (a NaN would print a NaN ETTR, 1e6 days would never end)."""
    check_gpus(gpus)
    positive(days=days, mtbf_seconds=mtbf, save_seconds=save, interval_seconds=interval)
    not_negative(restart_seconds=restart)
    if days > MAX_DAYS:
        raise UsageError(f"days: at most {MAX_DAYS} (ten years), got {days:g}")
    for name, value, low, high in (("runs", runs, 2, MAX_RUNS), ("seed", seed, 0, 2**63 - 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise UsageError(f"{name}: must be a whole number from {low} to {high:,}, got {value}")
    events = runs * days * 86400 * (1 / interval + 1 / mtbf)
    if events > MAX_EVENTS:
        raise UsageError(
            f"about {events:,.0f} saves and failures to simulate, more than {MAX_EVENTS:,}: "
            "fewer runs or days, or a longer interval"
        )


def simulate(
    gpus: int,
    days: float,
    mtbf: float,
    save: float,
    interval: float,
    restart: float,
    seed: int = 0,
    runs: int = 200,
    blocking: float | None = None,
) -> Simulation:
    _check(gpus, days, mtbf, save, interval, restart, seed, runs)
    blocking = save if blocking is None else blocking
    if not (math.isfinite(blocking) and 0 < blocking <= save):
        raise UsageError(f"blocking: must be in (0, save], got {blocking}")
    horizon = days * 86400
    rng = np.random.default_rng(seed)
    kept, failures = np.empty(runs), np.empty(runs)
    for i in range(runs):
        kept[i], failures[i] = _one(rng, horizon, mtbf, save, blocking, interval, restart)
    ratios = kept / horizon
    mean, half = float(ratios.mean()), Z95 * float(ratios.std(ddof=1)) / math.sqrt(runs)
    return Simulation(
        gpus,
        days,
        mtbf,
        save,
        blocking,
        interval,
        restart,
        runs,
        seed,
        mean,
        (mean - half, mean + half),
        float(failures.mean()),
        gpus * (horizon - float(kept.mean())) / 3600,
    )


def save_cost_for(target: float, mtbf: float, restart: float) -> float | None:
    """The save cost C at which Daly's interval reaches ``target`` ETTR (first order), or None
    when no save cost does (the restarts alone cost more)."""

    def at(save: float) -> float:
        return ettr(save, mtbf, restart, daly(save, mtbf)[0])

    low, high = 1e-6, mtbf
    if at(low) < target:
        return None
    for _ in range(100):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if at(middle) >= target else (low, middle)
    return low


def restart_for(target: float, mtbf: float, save: float) -> float | None:
    """The restart time R at which Daly's interval reaches ``target`` ETTR (first order)."""
    interval = daly(save, mtbf)[0]
    restart = mtbf * (1 - save / interval - target) - interval / 2
    return restart if restart >= 0 else None
