"""Goodput as the CLI and the flow both compute it, from the job's snapshot
(tasks.goodput.snapshot): the ledger of its records, save times and incidents, and the interval
advice from the measured C, M and R (each overridable), with the job's current interval from its
checkpoint's args; the per-day chart; a simulation beside the closed forms and the job's measured
recoveries."""

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from tasks.errors import UsageError
from tasks.goodput.advice import Advice, advise, ettr, ettr_exact
from tasks.goodput.measure import CAUSES, Figure, GoodputLedger, measure
from tasks.goodput.simulate import Simulation, restart_for, save_cost_for, simulate
from tasks.goodput.snapshot import JobSnapshot, read_job
from tasks.job.save_log import p99
from tasks.job.step_records import Steps
from tasks.plots import markdown_image, png, pyplot

# An advised interval this far from the job's own is worth a line in the summary.
INTERVAL_GAP = 0.25
# The ETTR a simulation says what it would take to reach (the JSON keys name it: *_for_97).
TARGET_ETTR = 0.97


def _interval(save_interval: int | None, steps: Steps | None) -> Figure:
    """The job's checkpoint interval: its --save-interval (checkpoint args) times its median step
    time (records or log)."""
    if save_interval is None or steps is None or not len(steps):
        return Figure(None, "not measured: no checkpoint args or step times")
    step = float(np.nanmedian(steps.step_seconds))
    return Figure(
        save_interval * step, f"--save-interval {save_interval} (checkpoint args) x median step {step:.3f} s"
    )


def ledger(job: JobSnapshot, since: float | None = None) -> GoodputLedger:
    """The job's ledger from its snapshot: steps, incidents, save times, and its interval."""
    return measure(
        job.name,
        job.steps,
        list(job.incidents),
        (list(job.save_times), job.save_source),
        since,
        _interval(job.save_interval, job.steps),
    )


# The option that gives each of the advice's inputs when the ledger cannot measure it.
_FLAGS = {"save": "--save-seconds", "mtbf": "--mtbf-hours", "restart": "--restart-minutes"}


def advice(
    job: JobSnapshot,
    measured: GoodputLedger,
    save: float | None = None,
    mtbf_hours: float | None = None,
    restart_minutes: float | None = None,
    interval_minutes: float | None = None,
    gpus: int | None = None,
    checkpoint_tb: float | None = None,
) -> Advice:
    """The advice from the given values, else the measured ones; a value neither given nor
    measured is a usage error naming the option. ``gpus`` defaults to the job's (recovery.gpus,
    else its world size); the checkpoint's size (for the storage written a day) to the newest
    checkpoint's, left out when there is none."""
    sources: dict[str, str] = {}

    def pick(given, figure_seconds, figure_source, option, scale):
        if given is not None:
            sources[option] = "given"
            return given * scale
        if figure_seconds is None:
            flag = _FLAGS[option]
            raise UsageError(
                f"{option}: not measured for {job.name} "
                f"({figure_source.removeprefix('not measured: ')}); give {flag}"
            )
        sources[option] = figure_source
        return figure_seconds

    c = pick(save, measured.save_seconds.seconds, measured.save_seconds.source, "save", 1)
    m = pick(mtbf_hours, measured.mtbf.seconds, measured.mtbf.source, "mtbf", 3600)
    r = pick(
        restart_minutes, measured.restart_seconds.seconds, measured.restart_seconds.source, "restart", 60
    )
    if interval_minutes is not None:
        t, sources["interval"] = interval_minutes * 60, "given"
    else:
        t, sources["interval"] = measured.interval.seconds, measured.interval.source
    size = Figure(checkpoint_tb * 1e12, "given") if checkpoint_tb is not None else job.checkpoint_bytes
    return advise(
        c,
        m,
        r,
        t,
        job.gpus if gpus is None else gpus,
        {
            "save": sources["save"],
            "mtbf": sources["mtbf"],
            "restart": sources["restart"],
            "interval": sources["interval"],
            "checkpoint": size.source,
        },
        size.seconds,
    )


@dataclass
class MeasuredSaves:
    """The job's saves as measured: the blocking part per save (Megatron-LM's timer), an async
    save's background write (scheduled to finalized, from the log's times) and each save on the
    store (first data file to ``.metadata``), against the job's save interval."""

    source: str
    blocking: list[float]
    background: list[float]
    store: list[float]
    interval_seconds: float | None

    @property
    def queued(self) -> bool:
        """A background write slower than the interval: the next save starts before it finished."""
        slowest = max(self.background, default=0.0)
        return bool(self.interval_seconds and slowest > self.interval_seconds)

    def lines(self) -> list[str]:
        def spread(values: list[float]) -> str:
            median = statistics.median(values)
            return f"median {median:.2f} s, p99 {p99(values):.2f} s, max {max(values):.2f} s"

        out = [f"saves measured ({self.source}): {len(self.blocking)}; blocking {spread(self.blocking)}"]
        if self.background:
            overlap = (
                f"; {statistics.median(self.background) / self.interval_seconds:.0%} of the "
                f"{self.interval_seconds:.0f} s interval runs beside a write"
                if self.interval_seconds
                else ""
            )
            out.append(f"async background writes: {len(self.background)}; {spread(self.background)}{overlap}")
        if self.store:
            out.append(f"on the store (first data file to .metadata): {spread(self.store)}")
        if self.queued:
            out.append(
                f"WARNING: a background write took {max(self.background):.1f} s, longer than the "
                f"{self.interval_seconds:.0f} s interval: saves would queue (Megatron-LM waits for the "
                "previous save before the next)"
            )
        return out

    def to_dict(self) -> dict:
        return asdict(self) | {"queued": self.queued}


def measured_saves(job: JobSnapshot, interval_seconds: float | None) -> MeasuredSaves | None:
    """The job's measured saves, or None without any measured blocking time."""
    if not job.save_times:
        return None
    log = job.save_log
    background = [b for s in (log.saves.values() if log else []) if (b := s.background_seconds) is not None]
    blocking, store = list(job.save_times), list(job.store_saves)
    return MeasuredSaves(job.save_source, blocking, background, store, interval_seconds)


def interval_note(found: Advice) -> str | None:
    """A line when the advised interval is more than INTERVAL_GAP away from the job's."""
    if found.interval_seconds is None:
        return None
    advised = found.daly_minutes * 60
    gap = abs(advised - found.interval_seconds) / found.interval_seconds
    if gap <= INTERVAL_GAP:
        return None
    return (
        f"the advised interval ({found.daly_minutes:.1f} min) differs from the job's "
        f"({found.interval_seconds / 60:.1f} min) by {gap:.0%}: change --save-interval"
    )


@dataclass
class SimulationReport:
    """A simulated ETTR beside the closed forms (which see only the blocking part of a save),
    what the job's measured recovery time would give, and what ETTR >= TARGET_ETTR would take."""

    simulation: Simulation
    first_order: float
    exact: float
    measured_restart: Figure | None  # None: the job's ledger has no recovery
    with_measured: Simulation | None
    save_for_target: float | None
    restart_for_target: float | None

    def to_dict(self) -> dict:
        measured = self.measured_restart
        return {
            **self.simulation.to_dict(),
            "ettr_first_order": self.first_order,
            "ettr_exact": self.exact,
            "measured_restart_seconds": measured.seconds if measured else None,
            "measured_restart_source": measured.source if measured else "not measured",
            "ettr_with_measured_restart": self.with_measured.ettr if self.with_measured else None,
            "save_seconds_for_97": self.save_for_target,
            "restart_seconds_for_97": self.restart_for_target,
        }

    def lines(self) -> list[str]:
        run = self.simulation
        low, high = run.ettr_ci
        lines = [
            f"ETTR {run.ettr:.2%} (95% CI {low:.2%} to {high:.2%}, {run.runs} runs of {run.days:g} days, "
            f"{run.failures_per_run:.1f} failures a run); closed forms: first order {self.first_order:.2%}, "
            f"exact {self.exact:.2%}; {run.gpu_hours_lost:,.0f} GPU-hours lost a run at {run.gpus} GPUs"
        ]
        if self.with_measured and self.measured_restart:
            lines.append(
                f"with the measured recovery time ({self.measured_restart.seconds / 60:.1f} min, "
                f"{self.measured_restart.source}): ETTR {self.with_measured.ettr:.2%}"
            )
        lines.append(
            f"ETTR >= {TARGET_ETTR:.0%} at Daly's interval needs "
            + (
                f"a save cost of at most {self.save_for_target:.0f} s at this recovery time"
                if self.save_for_target
                else "faster recoveries: no save cost is enough"
            )
            + (
                f", or recoveries within {self.restart_for_target / 60:.1f} min at this save cost"
                if self.restart_for_target is not None
                else ""
            )
        )
        return lines


def simulation_report(
    profile: Callable[[], object],
    gpus: int,
    days: float,
    mtbf_hours: float,
    save_seconds: float,
    interval_minutes: float,
    recover_minutes: float,
    blocking_seconds: float | None = None,
    runs: int = 200,
    seed: int = 0,
) -> SimulationReport:
    """Simulate the given job, then again with the median recovery time the profile's job
    measured, when its ledger has one (``profile`` loads the profile: it is read only once the
    inputs have passed the simulation's checks)."""
    m, c, t, r = mtbf_hours * 3600, save_seconds, interval_minutes * 60, recover_minutes * 60
    result = simulate(gpus, days, m, c, t, r, seed, runs, blocking_seconds)
    restart = ledger(read_job(profile())).restart_seconds
    measured = restart if restart.seconds is not None else None
    with_measured = (
        simulate(gpus, days, m, c, t, measured.seconds, seed, runs, blocking_seconds) if measured else None
    )
    return SimulationReport(
        result,
        ettr(result.blocking_seconds, m, r, t),
        ettr_exact(result.blocking_seconds, m, r, t),
        measured,
        with_measured,
        save_cost_for(TARGET_ETTR, m, r),
        restart_for(TARGET_ETTR, m, c),
    )


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def ledger_lines(found: GoodputLedger) -> list[str]:
    def value(figure) -> str:
        if figure.seconds is None:
            return f"not measured ({figure.source.removeprefix('not measured: ')})"
        return f"{duration(figure.seconds)} ({figure.source})"

    lines = [f"goodput of {found.job}" + (f" since {found.since}" if found.since else "")]
    lines.append(f"  wall time: {value(found.wall)}")
    lines.append(f"  productive: {value(found.productive)}")
    for cause in CAUSES:
        lines.append(f"  lost to {cause}: {value(found.lost[cause])}")
    skipped = found.untrained
    if skipped.iterations:
        tokens = f"{skipped.tokens:,} tokens" if skipped.tokens is not None else "tokens not known"
        lines.append(
            f"  not trained (data skipped): iterations {', '.join(map(str, skipped.iterations))}, "
            f"{tokens} ({skipped.source})"
        )
    lines.append(f"  ETTR: {found.ettr:.2%}" if found.ettr is not None else "  ETTR: not measured")
    lines.append(f"  incidents: {found.incidents}; MTBF: {value(found.mtbf)}")
    return lines


def per_day_png(found: GoodputLedger) -> bytes:
    """One stacked bar per day: productive hours and the hours lost to each incident cause."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(9, 3.5), dpi=100)
    days = [d["day"] for d in found.per_day]
    bottom = np.zeros(len(days))
    for name in ("productive", *CAUSES[1:]):
        values = np.array([d[name] for d in found.per_day])
        if values.any():
            ax.bar(days, values, bottom=bottom, label=name)
            bottom += values
    ax.set_ylabel("hours")
    ax.set_title(f"goodput of {found.job} per day (UTC)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return png(fig)


def markdown(found: GoodputLedger, advice_lines: list[str], note: str | None) -> str:
    image = markdown_image("goodput per day", per_day_png(found)) if found.per_day else None
    parts = [f"# goodput: {found.job}", ""]
    if note:
        parts += [f"**{note}**", ""]
    parts += [f"- {line.strip()}" for line in ledger_lines(found)[1:]]
    parts += ["", "## interval advice", "", *(f"- {line}" for line in advice_lines)]
    if image:
        parts += ["", image]
    return "\n".join(parts)
