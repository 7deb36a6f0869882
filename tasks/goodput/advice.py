"""Checkpoint-interval advice: Young's and Daly's intervals and the expected effective training
time ratio (ETTR), from the save cost C, the mean time between failures M and the restart cost R.

All times in seconds. Young (1974): T = sqrt(2CM). Daly (2006), higher order, for C < 2M:
T = sqrt(2CM) * [1 + sqrt(C/2M)/3 + (C/2M)/9] - C, and T = M when C >= 2M. ETTR to first order:
1 - C/T - (R + T/2)/M (a save every T costs C; a failure every M costs R and, on average, half
an interval of lost work).
"""

import math
from dataclasses import asdict, dataclass

from tasks.errors import UsageError

# The most GPUs any job holds: a figure past it is a typing error, not a cluster.
MAX_GPUS = 10_000_000


def positive(**values: float | None) -> None:
    for name, value in values.items():
        if value is None or not math.isfinite(value) or value <= 0:
            raise UsageError(f"{name}: must be a positive number, got {value}")


def not_negative(**values: float | None) -> None:
    for name, value in values.items():
        if value is None or not math.isfinite(value) or value < 0:
            raise UsageError(f"{name}: must be a finite number, not negative, got {value}")


def check_gpus(gpus) -> None:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS:
        raise UsageError(f"gpus: must be a whole number from 1 to {MAX_GPUS:,}, got {gpus}")


def young(save: float, mtbf: float) -> float:
    positive(save_seconds=save, mtbf_seconds=mtbf)
    return math.sqrt(2 * save * mtbf)


def daly(save: float, mtbf: float) -> tuple[float, str | None]:
    """Daly's interval, and a note when his formula does not apply (C >= 2M: then T = M)."""
    positive(save_seconds=save, mtbf_seconds=mtbf)
    ratio = save / (2 * mtbf)
    if ratio >= 1:
        return mtbf, f"C ({save:.0f} s) >= 2M ({2 * mtbf:.0f} s): Daly's formula does not apply; T = M"
    return math.sqrt(2 * save * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save, None


def ettr(save: float, mtbf: float, restart: float, interval: float) -> float:
    """Expected ETTR to first order; below 0 it is 0 (the job makes no progress)."""
    positive(save_seconds=save, mtbf_seconds=mtbf, interval_seconds=interval)
    not_negative(restart_seconds=restart)
    return max(0.0, 1 - save / interval - (restart + interval / 2) / mtbf)


def ettr_exact(save: float, mtbf: float, restart: float, interval: float) -> float:
    """Expected ETTR without the first-order approximation, for exponential failures that do not
    strike during a restart: each interval of work plus its save is retried until it completes,
    at an expected (M + R)(e^((T + C)/M) - 1) of wall time."""
    positive(save_seconds=save, mtbf_seconds=mtbf, interval_seconds=interval)
    not_negative(restart_seconds=restart)
    exponent = (interval + save) / mtbf
    if exponent > 700:  # e^700 is near the largest float: no interval completes, ETTR is 0
        return 0.0
    return interval / ((mtbf + restart) * math.expm1(exponent))


@dataclass
class Advice:
    save_seconds: float
    mtbf_seconds: float
    restart_seconds: float
    interval_seconds: float | None  # the job's current interval
    gpus: int
    young_minutes: float
    daly_minutes: float
    daly_note: str | None
    ettr_now: float | None
    ettr_advised: float
    gpu_hours_per_day: float | None  # saved per day by moving to Daly's interval
    sources: dict[str, str]
    checkpoint_bytes: float | None = None  # one checkpoint's size, for the storage written a day
    write_bytes_per_day_now: float | None = None  # at the current interval
    write_bytes_per_day_advised: float | None = None  # at Daly's interval

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [
            f"save cost C = {self.save_seconds:.1f} s ({self.sources.get('save', 'given')}); "
            f"MTBF M = {self.mtbf_seconds / 3600:.2f} h ({self.sources.get('mtbf', 'given')}); "
            f"restart R = {self.restart_seconds / 60:.1f} min ({self.sources.get('restart', 'given')})",
            f"Young's interval sqrt(2CM): {self.young_minutes:.2f} min",
            f"Daly's interval: {self.daly_minutes:.2f} min"
            + (f" ({self.daly_note})" if self.daly_note else ""),
            f"expected ETTR at Daly's interval: {self.ettr_advised:.2%}",
        ]
        if self.interval_seconds is not None:
            out.append(
                f"expected ETTR at the current interval ({self.interval_seconds / 60:.2f} min, "
                f"{self.sources.get('interval', 'given')}): {self.ettr_now:.2%}; moving saves "
                f"{self.gpu_hours_per_day:.1f} GPU-hours a day at {self.gpus} GPUs"
            )
        if self.checkpoint_bytes is not None:
            now = (
                f"{tb(self.write_bytes_per_day_now)} a day at the current interval, "
                if self.write_bytes_per_day_now is not None
                else ""
            )
            out.append(
                f"storage written: {now}{tb(self.write_bytes_per_day_advised)} a day at Daly's "
                f"(a checkpoint of {tb(self.checkpoint_bytes)}, {self.sources.get('checkpoint', 'given')})"
            )
        return out


def tb(size: float) -> str:
    """Bytes in decimal terabytes (7e12: 7.00 TB), as storage is sold and billed."""
    return f"{size / 1e12:,.2f} TB"


def write_per_day(checkpoint_bytes: float, interval: float) -> float:
    """Bytes written a day by saving a checkpoint of this size every ``interval`` seconds."""
    positive(checkpoint_bytes=checkpoint_bytes, interval_seconds=interval)
    return checkpoint_bytes * 86400 / interval


def advise(
    save: float,
    mtbf: float,
    restart: float,
    interval: float | None,
    gpus: int,
    sources: dict[str, str] | None = None,
    checkpoint_bytes: float | None = None,
) -> Advice:
    """The advice; with ``checkpoint_bytes``, also the storage written a day at the current
    and at Daly's interval."""
    check_gpus(gpus)
    if checkpoint_bytes is not None:
        positive(checkpoint_bytes=checkpoint_bytes)
    t_young = young(save, mtbf)
    t_daly, note = daly(save, mtbf)
    advised = ettr(save, mtbf, restart, t_daly)
    now = ettr(save, mtbf, restart, interval) if interval is not None else None
    return Advice(
        save,
        mtbf,
        restart,
        interval,
        gpus,
        t_young / 60,
        t_daly / 60,
        note,
        now,
        advised,
        None if now is None else gpus * 24 * (advised - now),
        dict(sources or {}),
        checkpoint_bytes,
        None if checkpoint_bytes is None or interval is None else write_per_day(checkpoint_bytes, interval),
        None if checkpoint_bytes is None else write_per_day(checkpoint_bytes, t_daly),
    )
