"""The checks only the job's own resume makes, on top of those of any run started from a
checkpoint (``tasks.relaunch.continuity``): the checkpoint it resumed from is the one promoted
then, its batches take the next positions of the data order (and recomputed ones are the same
batches), and throughput and peak memory, over steady-state windows (after warm-up), hold up
against the baseline (``tasks.resume.baseline``).
"""

import math
from collections.abc import Sequence
from datetime import UTC, datetime

import numpy as np

from tasks.checkpoint.catalog import catalog
from tasks.checkpoint.facts import CheckpointFacts
from tasks.checkpoint.pointer import history_begins, pointer_during, read_pointer
from tasks.checkpoint.state import State, VerifyOptions
from tasks.health.fleet import relaunched_note
from tasks.job.step_records import Steps
from tasks.outcome import Check, Outcome
from tasks.relaunch.continuity import Continuity, ResumeCheck, Validation
from tasks.resume.baseline import median, throughput_of


class Validator(Continuity):
    """The resumed run against the run before its failure: every check (``run``)."""

    def __init__(
        self,
        facts: CheckpointFacts,
        before: Steps | None,
        after: Steps,
        settings,
        baseline: dict | None,
        verified_now: bool = False,
        relaunched: dict[str, dict | None] | None = None,
        skip: Sequence[int] = (),
    ):
        super().__init__(facts, before, after, settings, skip)
        self.baseline = self.result.baseline = baseline
        # It had no manifest when the run resumed: verified by this validation.
        self.verified_now = verified_now
        # The resumed job's nodes and their recorded conformance facts (tasks.health.fleet).
        self.relaunched = relaunched

    def run(self) -> Validation:
        self._promoted()
        self._resume_point()
        self._learning_rate()
        self._data_order()
        self._data_version()
        self._loss()
        self._memory()
        self._throughput()
        self._skipped()
        self._skip_window()
        return self.result

    def _promoted(self) -> None:
        """The resume must start from a checkpoint the pointer named shortly before the resumed
        run's first step (the promotion log says; an operator's rollback included). The window,
        ``resume.pointer_window_seconds``, covers the load and the clocks of two hosts. Not the
        pointer now: the resumed run's own saves move it on, and a later validation must pass."""
        f, a = self.facts, self.after
        if f.not_valid:
            self.add(
                ResumeCheck.PROMOTED, False, "a verified checkpoint", f"{f.directory.name}: {f.not_valid}"
            )
            return
        if not f.verified:
            self.add(
                ResumeCheck.PROMOTED, False, "a verified checkpoint", f"{f.directory.name} was never verified"
            )
            return
        if self.verified_now:
            # Nothing had verified it when the run resumed, so the pointer cannot have named it.
            self.result.checks.append(
                Check(
                    ResumeCheck.PROMOTED,
                    Outcome.WARN,
                    f"{f.directory.name} was verified after the "
                    "resume (it passed): the run resumed from a checkpoint nobody had "
                    "verified yet",
                    "a verified checkpoint",
                    "verified after the resume",
                )
            )
            return
        started = float(a.time[self.start]) if len(a) else float("nan")
        window = self.settings.pointer_window_seconds
        values = (
            pointer_during(f.directory.parent, started - window, started) if math.isfinite(started) else None
        )
        if values is None:
            self._promoted_without_log()
            return
        named = sorted(v for v in values if v is not None)
        begins = history_begins(f.directory.parent)
        if not named and begins is not None and started < begins:
            when = datetime.fromtimestamp(begins, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
            self.add(
                ResumeCheck.PROMOTED,
                None,
                "",
                "",
                f"the run resumed before the pointer's history begins ({when}, the first promotion "
                "ckptops logged): which checkpoint was promoted then is not known: not checkable",
            )
            return
        expected = (
            f"iteration {named[0]} (latest verified when the run resumed)"
            if len(named) == 1
            else f"one of iterations {', '.join(map(str, named)) or 'none'} (the pointer in the "
            f"{window:g} s before the run resumed)"
        )
        self.add(ResumeCheck.PROMOTED, f.iteration in named, expected, f"iteration {f.iteration}")

    def _promoted_without_log(self) -> None:
        """No start time (Megatron-LM logs) or no promotion log: the newest verified checkpoint
        up to where the failed run stopped, no newer than the pointer (a rollback) - as good as
        the save directory can tell (a checkpoint the resumed run re-saved looks the same)."""
        f = self.facts
        pointer = read_pointer(f.directory.parent)
        if pointer is None:
            self.add(
                ResumeCheck.PROMOTED, None, "", "", "no promotion pointer and no promotion log: not checkable"
            )
            return
        if self.before is None or not len(self.before):
            if pointer > f.iteration:
                self.add(
                    ResumeCheck.PROMOTED,
                    None,
                    "",
                    "",
                    f"the pointer has moved on (now {pointer}) and neither a "
                    "promotion log nor the records before the failure say what it was: not checkable",
                )
            else:
                self.add(
                    ResumeCheck.PROMOTED,
                    pointer == f.iteration,
                    f"iteration {pointer} (latest verified)",
                    f"iteration {f.iteration}",
                )
            return
        failed_at = int(self.before.iteration.max())
        limit = min(pointer, failed_at)
        # The catalog's "valid" is a manifest that says so for the save now on disk.
        verified = [
            i.iteration
            for i in catalog(f.directory.parent, VerifyOptions(job=f.directory.parent.name))
            if i.state is State.VALID
        ]
        expected = max((it for it in verified if it <= limit), default=None)
        self.add(
            ResumeCheck.PROMOTED,
            expected == f.iteration,
            f"iteration {expected} (latest verified up to the failure at {failed_at})",
            f"iteration {f.iteration}",
        )

    def _data_order(self) -> None:
        a, b, f = self.after, self.before, self.facts
        positions = a.batch_position[self.rows]
        if not self.rows.size or np.isnan(positions).all():
            self.add(
                ResumeCheck.DATA_ORDER,
                None,
                "",
                "",
                "no batch positions or IDs in these records (Megatron-LM logs do not have them)",
            )
            return
        counts = np.where(np.isnan(a.batch_count[self.rows]), f.global_batch_size, a.batch_count[self.rows])
        expected = f.consumed + np.concatenate(([0.0], np.cumsum(counts)[:-1]))
        expected += self._skipped_by(a.iteration[self.rows]) * f.global_batch_size  # passed untrained
        bad = []
        wrong_position = np.nonzero(positions != expected)[0]
        if wrong_position.size:
            k = wrong_position[0]
            bad.append(
                (
                    int(a.iteration[self.rows[k]]),
                    f"position {int(expected[k])}",
                    f"position {positions[k]:.0f}",
                )
            )
        wrong_batch, compared = 0, 0
        if self.recomputed.size:
            theirs = b.batch_digest[self.recomputed_before]
            mine = a.batch_digest[self.recomputed]
            compared = sum(t is not None for t in theirs)
            differ = np.array([t is not None and m != t for m, t in zip(mine, theirs)], dtype=bool)
            wrong_batch = int(differ.sum())
            if wrong_batch:
                k = np.nonzero(differ)[0][0]
                bad.append(
                    (
                        int(a.iteration[self.recomputed[k]]),
                        f"the batch of the run before (digest {theirs[k]})",
                        f"digest {mine[k]}",
                    )
                )
        if bad:
            it, expected_text, observed = min(bad)
            self.add(
                ResumeCheck.DATA_ORDER,
                False,
                f"{expected_text} at iteration {it}",
                observed,
                f"{wrong_position.size} positions and {wrong_batch} recomputed batches differ",
            )
        elif not compared:
            # Positions follow on, but no batch could be compared: a changed seed or shuffle
            # would look the same. Not a pass.
            self.add(
                ResumeCheck.DATA_ORDER,
                None,
                "",
                "",
                f"positions contiguous from sample {f.consumed}, but no recomputed "
                "batch to compare (a resume at the checkpoint, or records without batch IDs)",
            )
        else:
            self.add(
                ResumeCheck.DATA_ORDER,
                True,
                f"{compared} recomputed batches identical, positions contiguous from sample {f.consumed}",
                "as expected",
            )

    def _window(self, values: np.ndarray) -> float | None:
        rows = self.rows[self.settings.warmup_steps :]
        if rows.size < self.settings.min_steps:
            return None
        return median(values[rows])

    def _steady_state(self, name: str, median: str, values: np.ndarray, kind: str, now_kind, mismatch: str):
        """(baseline, resumed) medians to compare, or None after saying why they cannot be."""
        baseline = self.baseline or {}
        base, now = baseline.get(median), self._window(values)
        if not base or now is None:
            self.add(name, None, "", "", "no baseline (or a zero one) or too few steady-state steps")
            return None
        if baseline.get(kind) != now_kind:
            self.add(name, None, "", "", mismatch)
            return None
        return base, now

    def _memory(self) -> None:
        pair = self._steady_state(
            ResumeCheck.PEAK_MEMORY,
            "peak_memory_median",
            self.after.peak_memory,
            "memory_kind",
            self.after.memory_kind,
            "baseline and resumed run measure memory differently",
        )
        if pair is None:
            return
        (base, now), band = pair, self.settings.memory_band
        ok = abs(now - base) <= band * base
        self.add(
            ResumeCheck.PEAK_MEMORY,
            ok,
            f"{base / 2**20:.1f} MiB +-{band:.0%}",
            f"{now / 2**20:.1f} MiB ({now / base - 1:+.1%})",
        )

    def _throughput(self) -> None:
        throughput, unit = throughput_of(self.after, self.facts)
        pair = self._steady_state(
            ResumeCheck.THROUGHPUT,
            "throughput_median",
            throughput,
            "throughput_unit",
            unit,
            f"baseline in {(self.baseline or {}).get('throughput_unit')}, the resumed run in {unit}",
        )
        if pair is None:
            return
        (base, now), drop = pair, self.settings.throughput_drop
        ok = now >= (1 - drop) * base
        self.add(
            ResumeCheck.THROUGHPUT,
            ok,
            f">= {(1 - drop) * base:.4g} {unit} ({1 - drop:.0%} of {base:.4g})",
            f"{now:.4g} {unit} ({now / base - 1:+.1%})",
            # A slower resume on other nodes: name the ones that differ from the rest.
            relaunched_note(self.relaunched) if not ok and self.relaunched is not None else "",
        )
