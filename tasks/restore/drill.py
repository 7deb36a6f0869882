"""A restore drill: restore the newest good checkpoint for real, load it for real, time it.

    source=shared   the promoted checkpoint on the shared store (a lease keeps retention off it)
    source=archive  the newest committed archive entry

Phases, each timed with its bytes: ``copy`` (or download) into a scratch directory, ``verify``
the copy against the manifest of what was copied, ``load`` it with ckptops' loader into a model
and optimizer rebuilt from the checkpoint (``tasks.restore.loader``), on the drill's layout.
Then check what was loaded: iteration, consumed samples, scheduler state, and on every rank a
sample of tensors equal to the stored ones. The restore window (the phases' sum) is compared
with the profile's budget. A drill never writes to its source and always removes its scratch
directory, and nothing else (``tasks.restore.scratch``: only a folder it provably made); the
load's log and report are kept in the job's history.
"""

import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path

from tasks.archive.entries import archived_manifest, committed_iterations, entry_key, newest_committed
from tasks.checkpoint import layout
from tasks.checkpoint.facts import scheduler_unit
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.manifest import Manifest, now_iso, valid_for_this_save, verified_newest_first
from tasks.checkpoint.pins import pinned
from tasks.checkpoint.pointer import promoted
from tasks.checkpoint.signing import Trust
from tasks.checkpoint.state import State, VerifyOptions
from tasks.checkpoint.verify import record_certification, verify_checkpoint
from tasks.errors import CkptopsError, UsageError
from tasks.notify import send
from tasks.outcome import Check, Outcome
from tasks.restore.continuation import Continued, checkable_up_to, continuation_sources, continue_training
from tasks.restore.history import DrillSource, append_drill, drill_files
from tasks.restore.launch import drill_layout, run_loader
from tasks.restore.report import LoadReport
from tasks.restore.scratch import Scratch, clear_stale_scratch, make_scratch, remove_scratch
from tasks.storage.archive import ArchiveStore
from tasks.storage.local import atomic_write


def _make_folders(destination: Path, manifest: Manifest) -> None:
    """The folders of the manifest's files (a Bridge checkpoint's tokenizer/) in the drill's own
    copy: an S3 download writes into existing folders only. Names are the manifest's, checked
    to stay inside (``manifest._inside``)."""
    for folder in sorted({(destination / f.path).parent for f in manifest.files} - {destination}):
        folder.mkdir(exist_ok=True)


class DrillCheck(StrEnum):
    """What a drill checks of the loaded state, as its reports and the UI name them."""

    MODEL = "model"
    ITERATION = "iteration"
    CONSUMED_SAMPLES = "consumed samples"
    SCHEDULER = "scheduler"
    TENSORS = "tensors"
    CONTINUATION = "continuation"  # trained on from the restored copy, against the original run
    RESTORED = "restored copy"  # verified again after the continuation trained from it


@dataclass
class Phase:
    name: str
    seconds: float
    bytes: int

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class DrillReport:
    job: str
    source: DrillSource
    started_at: str
    ok: bool = False
    reason: str = ""
    iteration: int | None = None
    location: str | None = None
    phases: list[Phase] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    budget_seconds: float = 0.0
    host: str = field(default_factory=socket.gethostname)
    id: str = ""
    layout: dict = field(default_factory=dict)  # the drill's TP, PP, DP
    log: str | None = None  # the load's own output, kept in the history
    cleared: list[str] = field(default_factory=list)  # earlier drills' scratch, removed: their drill is gone
    left: list[str] = field(default_factory=list)  # in the scratch dir, not provably a drill's: left alone
    continuation_seconds: float | None = None  # training on from the copy (not in the window)
    certified: bool | None = None  # the job's checkpoint recorded as certified by this drill
    continuation_log: str | None = None  # the continued run's output, kept in the history
    continuation_series: dict | None = None  # both runs' loss and LR per iteration, for the plot

    @property
    def window_seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["checks"] = [c.to_dict() for c in self.checks]
        data["window_seconds"] = self.window_seconds
        return data

    def line(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        timings = ", ".join(f"{p.name} {p.seconds:.2f}s ({p.gbps:.2f} GB/s)" for p in self.phases)
        return (
            f"{verdict} drill from {self.source}, iteration {self.iteration}: window "
            f"{self.window_seconds:.2f}s of {self.budget_seconds:g}s budget"
            + (f" [{timings}]" if timings else "")
            + ("" if self.ok else f": {self.reason}")
            + ("; the checkpoint is certified" if self.certified else "")
        )


class _Drill:
    def __init__(
        self, profile, source: str, progress: Callable[[int], None] | None, continue_steps: int | None = None
    ):
        if source not in tuple(DrillSource):
            raise UsageError(f"--source {source!r}: use {' or '.join(DrillSource)}")
        source = DrillSource(source)
        if profile.drill is None:
            raise UsageError(f"{profile.source}: no drill section")
        if source is DrillSource.ARCHIVE and profile.archive is None:
            raise UsageError(f"{profile.source}: no archive section, no archive to drill from")
        self.profile, self.source, self.progress = profile, source, progress
        self.continue_steps = profile.drill.continuation.steps if continue_steps is None else continue_steps
        # A profile that cannot continue fails before the restore.
        self.continuation = continuation_sources(profile) if self.continue_steps else None
        # A continuation drills the newest checkpoint it can compare (the run has logged what
        # follows it), which may be older than the newest.
        self.up_to = checkable_up_to(self.continuation[1], self.continue_steps) if self.continuation else None
        self.passed_over: int | None = None  # the newest, passed over for one that can be compared
        self.save_dir = profile.job.save_dir
        self.trust = Trust.of(profile)  # the job's manifests, here and in the archive, read as it says
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self.report = DrillReport(
            profile.job.name,
            source,
            now_iso(),
            budget_seconds=getattr(profile.drill.budget_seconds, source),
            id=f"{source}-{stamp}-{os.getpid()}",
        )
        # A random part: no folder can be planted at its name beforehand.
        self.scratch = Path(profile.drill.scratch_dir) / f"drill-{self.report.id}-{secrets.token_hex(4)}"
        self.began = time.time()  # a continuation's iterations are stamped after it
        self.made: Scratch | None = None  # the scratch folder, once this drill made it

    def run(self) -> DrillReport:
        scratch_dir = self.profile.drill.scratch_dir
        self.report.cleared, self.report.left = clear_stale_scratch(scratch_dir, self.save_dir)
        try:
            manifest = self._restore()
            self._verify(manifest)
            self._load(manifest)
            if self.continue_steps and not any(c.failed for c in self.report.checks):
                self._continue(manifest)
            self._judge()
        except UsageError:
            raise  # the profile is at fault, not the checkpoint: no drill result to record
        except CkptopsError as e:
            self.report.ok, self.report.reason = False, str(e)
        except FileNotFoundError as e:  # an object or file that should have been there
            self.report.ok, self.report.reason = False, f"{e.filename or e}: missing"
        except OSError as e:  # scratch full, permissions, a tool not installed
            self.report.ok, self.report.reason = False, f"{e.filename or 'drill'}: {e.strerror or e}"
        finally:
            kept = remove_scratch(self.made) if self.made else None
            if kept:
                self.report.left.append(kept)
        append_drill(self.save_dir, self.report)
        return self.report

    def _timed(self, name: str, action: Callable[[], int]) -> None:
        started = time.monotonic()
        nbytes = action()
        self.report.phases.append(Phase(name, time.monotonic() - started, nbytes))

    def _restore(self) -> Manifest:
        self.made = make_scratch(self.scratch, self.save_dir, self.report.id)
        target = self.scratch / "restore"
        target.mkdir()
        if self.source is DrillSource.SHARED:
            return self._copy_shared(target)
        return self._download(target)

    def _copy_shared(self, target: Path) -> Manifest:
        iteration = self._comparable(
            promoted(self.save_dir, self.trust).iteration,
            [i for i, _ in verified_newest_first(self.save_dir, trust=self.trust)],
        )
        source = self.save_dir / layout.iter_dir_name(iteration)
        destination = target / layout.iter_dir_name(iteration)
        self.report.iteration, self.report.location = iteration, str(source)
        # The lease keeps retention from deleting the checkpoint while it is being copied.
        with pinned(self.save_dir, iteration, f"drill-{os.getpid()}", "restore drill reading"):
            manifest = valid_for_this_save(source, iteration, self.trust)  # again, under the lease
            if manifest is None:
                raise CkptopsError(
                    f"{source.name}: promoted, but its manifest no longer says valid for this save"
                )
            destination.mkdir()

            def copy():
                _make_folders(destination, manifest)

                def one(entry):
                    shutil.copyfile(source / entry.path, destination / entry.path)
                    if self.progress:
                        self.progress(entry.size)

                with ThreadPoolExecutor(max_workers=min(8, len(manifest.files) or 1)) as pool:
                    list(pool.map(one, manifest.files))
                return sum(f.size for f in manifest.files)

            self._timed("copy", copy)
        return manifest

    def _download(self, target: Path) -> Manifest:
        store = ArchiveStore.from_settings(self.profile.archive)
        job = self.profile.job.name
        iteration = newest_committed(store, job)
        if iteration is None:
            raise CkptopsError(f"{store.where(job)}: no committed archive entry to restore")
        iteration = self._comparable(iteration, committed_iterations(store, job))
        self.report.iteration, self.report.location = iteration, store.where(entry_key(job, iteration))
        manifest = archived_manifest(store, job, iteration, self.trust)
        destination = target / layout.iter_dir_name(iteration)
        destination.mkdir()
        _make_folders(destination, manifest)

        def download():
            store.get_files(
                [(entry_key(job, iteration, f.path), destination / f.path) for f in manifest.files],
                self.progress,
            )
            return sum(f.size for f in manifest.files)

        self._timed("download", download)
        return manifest

    def _comparable(self, newest: int, candidates: list[int]) -> int:
        """``newest``, or for a continuation that cannot compare it yet the newest of
        ``candidates`` before it that it can compare, if there is one."""
        if self.up_to is None or newest <= self.up_to:
            return newest
        older = [i for i in candidates if i <= self.up_to]
        if not older:
            return newest  # nothing to compare yet: the continuation will say so
        self.passed_over = newest
        return max(older)

    def _restored_dir(self, manifest: Manifest) -> Path:
        return self.scratch / "restore" / layout.iter_dir_name(manifest.iteration)

    def _verify(self, manifest: Manifest, timed: bool = True) -> None:
        directory = self._restored_dir(manifest)
        # The scratch copy is checked against the manifest it was copied by, never recorded.
        options = VerifyOptions(
            job=self.profile.job.name, megatron_core_version=self.profile.job.megatron_core_version
        )
        results = {}

        def verify():
            results["v"] = verify_checkpoint(directory, options, reference=manifest)
            return results["v"].bytes_read

        if timed:
            self._timed("verify", verify)
        else:
            verify()
        result = results["v"]
        if result.state is not State.VALID:
            failing = next((c for c in result.checks if not c.ok), None)
            where = (
                self.report.location
                if failing is None or not failing.file
                else f"{self.report.location}/{failing.file}"
            )
            raise CkptopsError(f"{where}: restored copy failed verification: {result.reason}")

    def _load(self, manifest: Manifest) -> None:
        directory = self._restored_dir(manifest)
        layout = drill_layout(self.profile.drill, manifest.layout)
        self.report.layout = {
            "tensor_parallel": layout.tensor_parallel,
            "pipeline_parallel": layout.pipeline_parallel,
            "data_parallel": layout.data_parallel,
        }
        log, kept_report = drill_files(self.save_dir, self.report.id)
        self.report.log = str(log)
        loaded = run_loader(self.profile, directory, layout, self.scratch / "load-report.json", log)
        atomic_write(kept_report, loaded.to_json().encode())
        # The phase is the load itself, timed inside the loader; starting the processes (imports,
        # process group) is the same for any checkpoint and is not part of the restore window.
        self.report.phases.append(Phase("load", loaded.load_seconds, manifest.totals["bytes"]))
        self.report.checks += self._checks(manifest, loaded)

    def _continue(self, manifest: Manifest) -> None:
        """Train on from the restored copy and compare with the original run (not part of the
        restore window: the budget is for getting a checkpoint back, not for training)."""
        started = time.monotonic()
        restored = self._restored_dir(manifest)
        kept = Path(self.report.log).with_suffix(".continuation.log")
        continued = continue_training(
            self.profile,
            self.continuation,
            restored,
            self.scratch,
            self.continue_steps,
            kept,
            manifest,
            self.began,
        )
        if continued.touched is not None:
            unsent = send(
                self.profile,
                "a continuation drill changed the job's save directory",
                f"drill {self.report.id}: {continued.touched}: check the pointer, the trackers and the "
                "promoted checkpoint before the next resume",
            )
            continued.checks[-1].detail += f"; {unsent}" if unsent else ""
        elif continued.outcome is not Outcome.UNCHECKED:
            continued = self._verified_again(manifest, continued)
        self.report.continuation_log = str(kept) if kept.exists() else None
        self.report.continuation_seconds = time.monotonic() - started
        self.report.continuation_series = continued.series
        detail = continued.detail
        if self.passed_over is not None:
            detail += (
                f"; iteration {manifest.iteration}, the newest whose next {self.continue_steps} "
                f"iterations the original run has logged ({self.passed_over} is newer)"
            )
        self.report.checks += [Check(DrillCheck.CONTINUATION, continued.outcome, detail), *continued.checks]
        if continued.outcome is not Outcome.UNCHECKED:
            self._certify(manifest, continued)

    def _verified_again(self, manifest: Manifest, continued: Continued) -> Continued:
        """The restored copy after the continuation, against the manifest it was copied by: a
        script that changed what it trained from proves nothing of the checkpoint."""
        try:
            self._verify(manifest, timed=False)
        except CkptopsError as e:
            said = f"after the continuation: {e}: not certified"
            return Continued(
                Outcome.UNCHECKED, "not certified", [Check(DrillCheck.RESTORED, Outcome.FAIL, said)]
            )
        return continued

    def _certify(self, manifest: Manifest, continued: Continued) -> None:
        """Record the continuation in the manifest of the job's own checkpoint the drill
        restored (the same files), if it is still there, valid and the same save."""
        original = self.save_dir / layout.iter_dir_name(manifest.iteration)
        ok, detail = continued.outcome is Outcome.PASS, continued.detail
        record = {
            "ok": ok,
            "drill": self.report.id,
            "source": self.source.value,
            "steps": self.continue_steps,
            "tolerance": self.profile.drill.continuation.tolerance,
            "largest_difference": continued.largest_difference,
            "at": now_iso(),
            "detail": detail if ok else f"loads, does not resume: {detail}",
        }
        with job_lock(self.save_dir, self.profile.verify.lock_timeout_seconds) as held:
            self.report.certified = (
                record_certification(original, manifest.files, record, held, self.trust) and ok
            )

    @staticmethod
    def _checks(manifest: Manifest, loaded: LoadReport) -> list[Check]:
        def check(name: DrillCheck, ok: bool, expected, observed, detail: str = "") -> Check:
            return Check(name, Outcome.PASS if ok else Outcome.FAIL, detail, str(expected), str(observed))

        consumed = manifest.consumed_train_samples
        steps = (loaded.scheduler or {}).get("num_steps")
        # Either count the scheduler may keep must match the checkpoint's progress exactly (net
        # of the samples --iterations-to-skip passed, for which it does not step).
        skipped = loaded.skipped_train_samples
        batch = max(1, (consumed or 0) // max(1, manifest.iteration)) if skipped else 1
        unit = scheduler_unit(steps, consumed, manifest.iteration, skipped, batch)
        inferred = (
            f"; inferred from the tensor shapes: {'; '.join(loaded.inferred)}" if loaded.inferred else ""
        )
        optimizer = ("loaded" if loaded.optimizer_loaded else "not loaded (the job saved none)") + (
            f" ({loaded.optimizer_format})" if loaded.optimizer_format else ""
        )
        layout = loaded.layout
        model = (
            f"{loaded.model}{inferred}; on TP {layout.get('tensor_parallel')} x PP "
            f"{layout.get('pipeline_parallel')} x DP {layout.get('data_parallel')} "
            f"({loaded.world_size} ranks); optimizer {optimizer}"
            + "".join(f"; {note}" for note in loaded.notes)
        )
        scheduler = (
            check(
                DrillCheck.SCHEDULER,
                unit is not None,
                f"{consumed} samples or {manifest.iteration} iterations",
                f"step {steps}",
                f"scheduler at step {steps} "
                f"({unit or 'neither the samples nor the iterations'} of the checkpoint), lr {loaded.lr}",
            )
            if loaded.optimizer_loaded
            else Check(DrillCheck.SCHEDULER, Outcome.UNCHECKED, "not loaded with the optimizer")
        )
        return [
            Check(DrillCheck.MODEL, Outcome.WARN if loaded.inferred else Outcome.PASS, model),
            check(
                DrillCheck.ITERATION,
                loaded.iteration == manifest.iteration,
                manifest.iteration,
                loaded.iteration,
                f"loaded {loaded.iteration}, manifest {manifest.iteration}",
            ),
            check(
                DrillCheck.CONSUMED_SAMPLES,
                loaded.consumed_train_samples == consumed,
                consumed,
                loaded.consumed_train_samples,
                f"loaded {loaded.consumed_train_samples}, manifest {consumed}",
            ),
            scheduler,
            check(
                DrillCheck.TENSORS,
                loaded.compared > 0 and not loaded.mismatches,
                "bit-equal to the stored bytes",
                ", ".join(loaded.mismatches) or "bit-equal",
                f"{loaded.compared} compared with the stored bytes on {len(loaded.ranks)} ranks, "
                f"differing: {', '.join(loaded.mismatches) or 'none'}",
            ),
        ]

    def _judge(self) -> None:
        failed = [c for c in self.report.checks if c.failed]
        if failed:
            self.report.ok, self.report.reason = False, f"{failed[0].name}: {failed[0].detail}"
        elif self.report.window_seconds > self.report.budget_seconds:
            self.report.ok = False
            self.report.reason = (
                f"restore window {self.report.window_seconds:.2f}s is over the "
                f"{self.report.budget_seconds:g}s budget"
            )
        else:
            continued = any(c.name == DrillCheck.CONTINUATION and c.ok for c in self.report.checks)
            self.report.ok, self.report.reason = (
                True,
                "restored, verified and loaded within budget"
                + (
                    f", and trained on {self.continue_steps} iterations as the original run did"
                    if continued
                    else ""
                ),
            )


def run_drill(
    profile, source: str, progress: Callable[[int], None] | None = None, continue_steps: int | None = None
) -> DrillReport:
    """Run one drill and record it in the job's drill history; with ``continue_steps`` (default
    the profile's ``drill.continuation.steps``), a continuation after the load."""
    return _Drill(profile, source, progress, continue_steps).run()
