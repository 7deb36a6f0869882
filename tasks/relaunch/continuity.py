"""Does a run started from a checkpoint go on as the run before it did? The checks a recovery's
relaunch (post-resume validation, ``tasks.resume``) and a continuation drill (``tasks.restore``)
both make, one by one.

Iterations after the checkpoint that the run before had already done are *recomputed* by the run
started from it: they must reproduce the same learning rate and (within the profile's tolerance,
bit-exact when nothing changed) the same loss and grad norm. Iterations beyond them must follow
the checkpoint's own LR schedule. The run must start right after the checkpoint, on the train
indices its manifest recorded, and skip no step and count no NaN the run before did not.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from tasks.checkpoint.batches import changed_indices, next_batch
from tasks.checkpoint.facts import CheckpointFacts
from tasks.errors import CkptopsError
from tasks.job.step_records import Steps
from tasks.outcome import Check, Outcome

# How a resume from a checkpoint silently becomes a run from nothing: Megatron-LM without
# --exit-on-missing-checkpoint starts from random weights, and Megatron-Bridge loaded another
# checkpoint than the one asked for, or none, without an error (its PR#4900, #5090, #5260, #3503).
_FROM_SCRATCH = (
    " (a checkpoint other than this one, or none, was loaded without an error: Megatron-LM "
    "without --exit-on-missing-checkpoint; Megatron-Bridge #4900, #5090, #5260, #3503)"
)


class ResumeCheck(StrEnum):
    """The checks of a post-resume validation (a continuation drill makes some of them), as
    their reports and the UI name them."""

    BASELINE = "baseline"  # unchecked when there is no steady-state baseline to compare with
    PROMOTED = "promoted checkpoint"
    RESUME_POINT = "resume point"
    LEARNING_RATE = "learning rate"
    DATA_ORDER = "data order"
    DATA_VERSION = "data version"  # the train indices the checkpoint's manifest recorded, unchanged
    LOSS = "loss and grad norm"
    PEAK_MEMORY = "peak memory"
    THROUGHPUT = "throughput"
    SKIPPED = "skipped and NaN iterations"
    SKIP_WINDOW = "skipped data"  # a relaunch past a data failure: exactly that window passed


_PROVENANCE = (ResumeCheck.PROMOTED, ResumeCheck.BASELINE)


@dataclass
class Validation:
    checkpoint: str
    iteration: int
    checks: list[Check] = field(default_factory=list)
    baseline: dict | None = None
    largest_difference: float | None = None  # of the recomputed losses and grad norms, relative

    @property
    def ok(self) -> bool:
        return not any(c.failed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.failed]

    def line(self) -> str:
        if self.ok:
            unchecked = [c.name for c in self.checks if c.outcome is Outcome.UNCHECKED]
            return f"VALIDATED resume from iteration {self.iteration}: every check passed" + (
                f" (not checkable here: {', '.join(unchecked)})" if unchecked else ""
            )
        # The resume's own faults first (learning rate, data, loss, memory, speed): where it
        # started from is named after them.
        first = min(self.failures, key=lambda c: c.name in _PROVENANCE)
        return (
            f"REJECTED resume from iteration {self.iteration}: {first.name}: expected {first.expected}, "
            f"observed {first.observed}" + (f" ({first.detail})" if first.detail else "")
        )

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint,
            "iteration": self.iteration,
            "ok": self.ok,
            "checks": [c.to_dict() for c in self.checks],
            "baseline": self.baseline,
        }


def schedule(facts: CheckpointFacts):
    """The learning rate after a given count of the scheduler's unit, by the checkpoint's own
    schedule (megatron-core's class, not a copy)."""
    from tasks.checkpoint.schedule import ScheduleError, scheduler_from_state

    try:
        scheduler = scheduler_from_state(
            SimpleNamespace(param_groups=[{}]),
            facts.scheduler,
            facts.warmup_init_lr,
            facts.wsd_decay_steps,
            facts.wsd_decay_style,
        )
    except ScheduleError as e:
        raise CkptopsError(f"{facts.directory.name}: {e}") from None

    def lr_at(count: int) -> float:
        scheduler.num_steps = count
        return scheduler.get_lr({})

    return lr_at


def _differ(
    mine: np.ndarray, theirs: np.ndarray, rel: np.ndarray | float, printed: np.ndarray | float = 0.0
) -> np.ndarray:
    """Which pairs differ by more than ``rel`` (relative) and by more than ``printed``, the most
    two rounded values can differ by (half of each side's unit in the last printed place); NaN on
    the reference side is skipped."""
    with np.errstate(invalid="ignore"):  # inf - inf
        close = (mine == theirs) | np.isclose(mine, theirs, rtol=rel, atol=0.0)
        close |= np.abs(mine - theirs) <= np.asarray(printed) * (1 + 1e-9)
    return ~close & ~np.isnan(theirs)


def _largest_relative(mine: np.ndarray, theirs: np.ndarray) -> float:
    """The largest relative difference of the pairs both sides have as finite numbers."""
    both = np.isfinite(mine) & np.isfinite(theirs)
    if not both.any():
        return 0.0
    m, t = mine[both], theirs[both]
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.where(m == t, 0.0, np.abs(m - t) / np.abs(t))
    return float(np.nan_to_num(relative, nan=0.0, posinf=np.inf).max())


def _flagged(steps: Steps) -> np.ndarray:
    """Iterations that were skipped, counted NaN, or whose loss or grad norm was not finite."""
    return (np.nan_to_num(steps.skipped) > 0) | (np.nan_to_num(steps.nan) > 0) | (steps.nonfinite > 0)


def _match(before: Steps | None, iterations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each iteration, whether the run before had it, and its row there (the last record of
    an iteration wins: a rerun's)."""
    if before is None or not len(before):
        return np.zeros(iterations.size, dtype=bool), np.zeros(iterations.size, dtype=np.int64)
    reversed_its = before.iteration[::-1]
    unique, first_in_reversed = np.unique(reversed_its, return_index=True)
    last_row = len(before) - 1 - first_in_reversed
    pos = np.clip(np.searchsorted(unique, iterations), 0, unique.size - 1)
    found = unique[pos] == iterations
    return found, last_row[pos]


def last_attempt(steps: Steps) -> int:
    """Where the last attempt starts in a file that attempts were appended to: where the
    attempt id changes (records), or in a log where a run says it loaded a checkpoint or the
    iteration stops increasing (logs have no id, and an attempt that died exactly at a checkpoint
    continues the numbering of the one before)."""
    restart = np.diff(steps.iteration) <= 0
    if steps.attempt.size == len(steps):
        restart |= steps.attempt[1:] != steps.attempt[:-1]
    if "loaded" in steps.columns:
        loaded = np.nan_to_num(steps.loaded, nan=-1.0)
        restart |= loaded[1:] != loaded[:-1]
    restarts = np.nonzero(restart)[0]
    return int(restarts[-1] + 1) if restarts.size else 0


class Continuity:
    """A run started from checkpoint ``facts`` (``after``, its records or log) against the run
    before it (``before``), with the profile's ``resume`` settings: each check adds its outcome
    to ``result``."""

    def __init__(
        self, facts: CheckpointFacts, before: Steps | None, after: Steps, settings, skip: Sequence[int] = ()
    ):
        self.facts, self.before, self.after, self.settings = facts, before, after, settings
        # Iterations the run was told to pass untrained (--iterations-to-skip), after the checkpoint.
        self.skip = np.array(sorted(i for i in set(skip) if i > facts.iteration), dtype=np.int64)
        self.result = Validation(str(facts.directory), facts.iteration)
        # Rows of the resumed run (its last attempt), in order, from after the checkpoint on.
        self.start = last_attempt(after) if len(after) else 0
        self.rows = self.start + np.nonzero(after.iteration[self.start :] > facts.iteration)[0]
        found, before_rows = _match(before, after.iteration[self.rows])
        self.recomputed, self.recomputed_before = self.rows[found], before_rows[found]
        self.beyond = self.rows[~found]
        logs = "megatron-log" in (after.kind, before.kind if before else "")
        # Logged values are rounded to a few digits; records carry full floats.
        self.lr_tolerance = 1e-5 if logs else 1e-12
        self.started_at_checkpoint = False  # the resume point says so (_resume_point)

    def add(self, name, ok, expected, observed, detail=""):
        self.result.checks.append(
            Check(
                name,
                Outcome.UNCHECKED if ok is None else Outcome.PASS if ok else Outcome.FAIL,
                detail,
                str(expected),
                str(observed),
            )
        )

    def _skipped_by(self, iterations: np.ndarray) -> np.ndarray:
        """How many of the skipped iterations come at or before each of ``iterations``."""
        return np.searchsorted(self.skip, iterations, side="right")

    def _expected_skipped(self, iterations: np.ndarray) -> np.ndarray:
        """The samples passed untrained by each of ``iterations``, as the checkpoint and the
        window say."""
        return self.facts.skipped_samples + self._skipped_by(iterations) * self.facts.global_batch_size

    def _skipped_samples(self) -> np.ndarray:
        """Per row, the samples passed untrained so far, as the log printed them (Megatron-LM's
        ``skipped samples``), else as the checkpoint and the window say."""
        a = self.after
        known = self._expected_skipped(a.iteration)
        printed = a.skipped_samples if "skipped_samples" in a.columns else np.full(len(a), np.nan)
        return np.where(np.isfinite(printed), printed, known)

    def continuation(self) -> Validation:
        """The checks that hold for a run continued elsewhere from a copy of the checkpoint (a
        drill): where it resumed, the schedule, the recomputed losses and grad norms against the
        original run's, and no new skipped or NaN step. Not the pointer, memory or speed, which
        belong to the job's own resume on its own nodes."""
        self._resume_point(load_line=True)
        self._learning_rate()
        self._data_version()
        self._loss()
        self._skipped()
        return self.result

    def _resume_point(self, load_line: bool = False) -> None:
        """The resumed run's first iteration is the checkpoint's next, after the checkpoint's
        consumed samples plus that iteration's batch. A log where Megatron-LM says it loaded
        another iteration is another checkpoint; a log without the line (rank 0 prints it, the
        last rank the iteration lines: with per-rank output files the last rank's has none) is
        placed by its first iteration and consumed samples alone, unless ``load_line``."""
        f, a = self.facts, self.after
        if not len(a):
            self.add(
                ResumeCheck.RESUME_POINT, False, f"iteration {f.iteration + 1}", "no records after the resume"
            )
            return
        first = int(a.iteration[self.start])
        loaded = a.loaded[self.start]
        said = f"Megatron-LM's 'successfully loaded checkpoint ... at iteration {f.iteration}'"
        if np.isfinite(loaded) and loaded != f.iteration:
            self.add(
                ResumeCheck.RESUME_POINT,
                False,
                said,
                f"iteration {loaded:.0f}",
                "the log shows another checkpoint loaded",
            )
            return
        expected = f.iteration + 1
        while expected in self.skip:  # a skipped iteration logs no line
            expected += 1
        if first != expected:
            self.add(
                ResumeCheck.RESUME_POINT,
                False,
                f"first iteration {expected}",
                f"first iteration {first}",
                "resumed from another checkpoint than this one"
                + (f": it started from scratch{_FROM_SCRATCH}" if first == 1 else ""),
            )
            return
        unsaid = a.kind == "megatron-log" and not np.isfinite(loaded)
        if unsaid and load_line:
            self.add(
                ResumeCheck.RESUME_POINT,
                False,
                said,
                "no such line before its steps",
                "the log does not show this checkpoint loaded",
            )
            return
        size = a.batch_count[self.start] if not np.isnan(a.batch_count[self.start]) else f.global_batch_size
        size += (expected - f.iteration - 1) * f.global_batch_size  # the skipped batches before it
        resumed_at = None if np.isnan(a.consumed[self.start]) else int(a.consumed[self.start] - size)
        fits = resumed_at == f.consumed
        # The first line of a run that started at the checkpoint averages its first iteration only.
        self.started_at_checkpoint = fits
        note = ""
        if resumed_at == 0 and f.consumed > 0:
            note = f"its sample count started from zero{_FROM_SCRATCH}"
        elif unsaid:
            note = "no load line in this log (rank 0 prints it): placed by its first iteration and "
            note += "consumed samples"
        self.add(
            ResumeCheck.RESUME_POINT,
            fits,
            f"iteration {f.iteration + 1} after {f.consumed} samples",
            f"iteration {first} after {resumed_at} samples",
            note,
        )

    def _learning_rate(self) -> None:
        a, b = self.after, self.before
        if not self.rows.size:
            self.add(ResumeCheck.LEARNING_RATE, None, "", "", "no resumed iterations")
            return
        bad = []
        if self.recomputed.size:
            differ = _differ(a.lr[self.recomputed], b.lr[self.recomputed_before], self.lr_tolerance)
            for i, j in zip(self.recomputed[differ][:1], self.recomputed_before[differ][:1]):
                bad.append((int(a.iteration[i]), b.lr[j], a.lr[i], "the run before the failure"))
            mismatched = int(differ.sum())
        else:
            mismatched = 0
        unit = self.facts.scheduler_unit
        if self.beyond.size and unit is None:
            steps = self.facts.scheduler.get("num_steps")
            self.add(
                ResumeCheck.LEARNING_RATE,
                None,
                "",
                "",
                f"the scheduler's step count at the checkpoint ({steps}) is "
                f"neither its samples ({self.facts.consumed}) nor its iterations ({self.facts.iteration}): "
                "what it counts is unknown, so its schedule cannot be replayed",
            )
            return
        lr_at = schedule(self.facts) if self.beyond.size else None
        # Beyond the recomputed steps, the learning rate after each iteration is the schedule's
        # at the count of its unit: samples consumed, or iterations done.
        # Megatron-LM's scheduler does not step for a skipped iteration.
        skipped = self._skipped_samples()
        counts = (
            a.consumed - skipped
            if unit == "samples"
            else a.iteration - skipped / self.facts.global_batch_size
        )
        for i in self.beyond:
            if np.isnan(counts[i]):
                continue
            expected = lr_at(int(counts[i]))
            if not (a.lr[i] == expected or math.isclose(a.lr[i], expected, rel_tol=self.lr_tolerance)):
                mismatched += 1
                if not bad:
                    bad.append(
                        (int(a.iteration[i]), expected, a.lr[i], f"the checkpoint's schedule, in {unit}")
                    )
        if bad:
            it, expected, observed, source = min(bad)
            self.add(
                ResumeCheck.LEARNING_RATE,
                False,
                f"{expected:.9g} at iteration {it} ({source})",
                f"{observed}",
                f"{mismatched} of {self.rows.size} iterations differ",
            )
        else:
            self.add(
                ResumeCheck.LEARNING_RATE,
                True,
                f"{self.recomputed.size} recomputed as before, "
                f"{self.beyond.size} on the checkpoint's schedule"
                + (f" (the scheduler counts {unit})" if self.beyond.size else ""),
                "all equal",
            )

    def _data_version(self) -> None:
        """The train indices the checkpoint's manifest recorded are the bytes in the data cache
        now (a rebuilt or replaced cache serves other batches from the same position), and the
        global batch they serve after the checkpoint, reported: the job's records carry digests
        of the tokens, not the dataset's sample numbers, so it is not compared."""
        recorded = self.facts.data_version
        if not recorded or not recorded.get("indices"):
            why = (recorded or {}).get("note") or "no data version recorded (a manifest of an older ckptops)"
            self.add(ResumeCheck.DATA_VERSION, None, "", "", why)
            return
        changed = changed_indices(recorded)
        if changed:
            self.add(
                ResumeCheck.DATA_VERSION,
                False,
                f"the train indices recorded at iteration {self.facts.iteration}",
                "; ".join(changed),
                f"the data cache {recorded['cache']} changed since the checkpoint was verified: "
                "the same position serves other samples",
            )
            return
        try:
            batch = next_batch(self.facts.directory, Path(recorded["cache"]))
            served = (
                f"; the batch after it: dataset samples {', '.join(str(s.sample) for s in batch.samples)}"
            )
        except CkptopsError as e:
            served = f"; the batch after it not computed: {e}"
        self.add(
            ResumeCheck.DATA_VERSION,
            True,
            f"the train indices recorded at iteration {self.facts.iteration} "
            f"(blend {recorded['blend'][:12]})",
            "unchanged",
            f"{len(recorded['indices'])} files in {recorded['cache']} as recorded{served}",
        )

    def _loss(self) -> None:
        if not self.recomputed.size:
            self.add(ResumeCheck.LOSS, None, "", "", "no recomputed iterations to compare")
            return
        a, b, tol = self.after, self.before, self.settings.loss_rel_tolerance
        first_tol = self.settings.first_rel_tolerance
        first_tol = tol if first_tol is None else first_tol
        # The first iteration after the checkpoint may be held tighter: nothing has drifted yet.
        iterations = a.iteration[self.recomputed]
        tolerances = np.where(iterations == self.facts.iteration + 1, first_tol, tol)
        # A printed loss is a mean over a window of iterations: compared only where both runs
        # printed it over the same window (a log's first lines after a start may not have).
        mine_from, theirs_from = a.loss_from[self.recomputed], b.loss_from[self.recomputed_before]
        if self.started_at_checkpoint:  # a log without its load line does not say where it began
            mine_from = np.where(
                (self.recomputed == self.start) & np.isnan(mine_from), float(self.facts.iteration), mine_from
            )
        same_window = np.isfinite(mine_from) & (mine_from == theirs_from)
        skipped = [int(i) for i in a.iteration[self.recomputed][~same_window]]
        bad, count, rounded, largest = [], 0, False, 0.0
        for name, rows in (("loss", same_window), ("grad_norm", np.ones_like(same_window))):
            mine = getattr(a, name)[self.recomputed][rows]
            theirs = getattr(b, name)[self.recomputed_before][rows]
            unit = f"{name}_printed_unit"
            printed = 0.5 * (
                getattr(a, unit)[self.recomputed][rows] + getattr(b, unit)[self.recomputed_before][rows]
            )
            differ = _differ(mine, theirs, tolerances[rows], printed)
            largest = max(largest, _largest_relative(mine, theirs))
            rounded |= bool((printed > 0).any())
            count += int(differ.sum())
            if differ.any():
                k = np.nonzero(differ)[0][0]
                at = int(a.iteration[self.recomputed][rows][k])
                bad.append((at, name.replace("_", " "), float(theirs[k]), float(mine[k])))
        note = ""
        if skipped:
            where = ", ".join(map(str, skipped))
            note = f"; loss not compared at {where} (printed over other iterations than before)"
        if rounded:
            note += "; a log's values to the precision it printed"
        self.result.largest_difference = largest
        within = f"{tol:g}" if first_tol == tol else f"{first_tol:g} at the first, {tol:g} after"
        note += f"; largest relative difference {largest:.3g}"
        if bad:
            it, name, expected, observed = min(bad)
            self.add(
                ResumeCheck.LOSS,
                False,
                f"{name} {expected!r} at iteration {it}",
                repr(observed),
                f"{count} values outside a relative tolerance of {within}{note}",
            )
        else:
            exact = "bit-exact" if tol == first_tol == 0 else f"within {within}"
            compared = int(same_window.sum())
            self.add(
                ResumeCheck.LOSS,
                True,
                f"{self.recomputed.size} recomputed iterations {exact}",
                f"as expected ({compared} losses and {self.recomputed.size} grad norms compared{note})",
            )

    def _skip_window(self) -> None:
        """A relaunch past a data failure: no skipped iteration trained, and the samples passed
        untrained moved by exactly the window (Megatron-LM's ``skipped samples`` where the log
        prints it), while consumed samples count every iteration as before."""
        a, f = self.after, self.facts
        if not self.skip.size:
            self._nothing_skipped()
            return
        window = ", ".join(map(str, self.skip))
        trained = np.intersect1d(a.iteration[self.rows], self.skip)
        if trained.size:
            self.add(
                ResumeCheck.SKIP_WINDOW,
                False,
                f"iterations {window} not trained",
                f"iteration {int(trained[0])} trained",
                "the relaunch did not pass the window it was told to skip",
            )
            return
        rows = self.rows
        if not rows.size or a.iteration[rows[-1]] < self.skip[-1]:
            self.add(ResumeCheck.SKIP_WINDOW, None, "", "", f"the run has not passed iterations {window} yet")
            return
        gbs = f.global_batch_size
        expected_skipped = self._expected_skipped(a.iteration[rows])
        expected_consumed = f.consumed + (a.iteration[rows] - f.iteration) * gbs
        printed = a.skipped_samples[rows] if "skipped_samples" in a.columns else np.full(rows.size, np.nan)
        wrong = np.nonzero(
            (np.isfinite(printed) & (printed != expected_skipped))
            | (np.isfinite(a.consumed[rows]) & (a.consumed[rows] != expected_consumed) & (not f.rampup))
        )[0]
        if wrong.size:
            k = wrong[0]
            self.add(
                ResumeCheck.SKIP_WINDOW,
                False,
                f"{int(expected_skipped[k])} samples skipped, {int(expected_consumed[k])} consumed at "
                f"iteration {int(a.iteration[rows[k]])}",
                f"{printed[k]:.0f} skipped, {a.consumed[rows[k]]:.0f} consumed",
                f"iterations {window} were to pass {self.skip.size * gbs} samples untrained, nothing else",
            )
            return
        said = "as Megatron-LM printed" if np.isfinite(printed).any() else "by consumed samples"
        self.add(
            ResumeCheck.SKIP_WINDOW,
            True,
            f"iterations {window} passed untrained ({self.skip.size * gbs} samples)",
            f"as expected ({said})",
        )

    def _nothing_skipped(self) -> None:
        """No window was asked for: a log whose skipped samples moved past the checkpoint's
        passed data no recovery decided to skip (a script's own --iterations-to-skip, Megatron's
        own skip from its rejected-result tracker file). A warning a person should read, not a
        rejection: Megatron may have skipped on its own evidence. Said only when it happened."""
        a, f = self.after, self.facts
        printed = a.skipped_samples[self.rows] if "skipped_samples" in a.columns else np.array([])
        moved = np.nonzero(np.isfinite(printed) & (printed != f.skipped_samples))[0]
        if moved.size:
            k = moved[0]
            self.result.checks.append(
                Check(
                    ResumeCheck.SKIP_WINDOW,
                    Outcome.WARN,
                    "the run passed data untrained that no recovery decided to skip",
                    f"{f.skipped_samples} samples skipped (the checkpoint's), none asked for",
                    f"{printed[k]:.0f} at iteration {int(a.iteration[self.rows[k]])}",
                )
            )

    def _skipped(self) -> None:
        a, b = self.after, self.before
        flagged = _flagged(a)
        if self.recomputed.size:  # the run before skipped these too: not new
            flagged[self.recomputed[_flagged(b)[self.recomputed_before]]] = False
        hits = self.rows[flagged[self.rows]]
        if hits.size:
            i = hits[0]
            values = f", loss {a.loss[i]}, grad norm {a.grad_norm[i]}" if a.nonfinite[i] else ""
            self.add(
                ResumeCheck.SKIPPED,
                False,
                "none",
                f"iteration {int(a.iteration[i])}: {int(a.skipped[i])} skipped, {int(a.nan[i])} NaN{values}",
                f"{hits.size} steps affected",
            )
        else:
            self.add(ResumeCheck.SKIPPED, True, "none", "none")
