"""Promotion: verify the new complete checkpoints, then point at the newest that passed.

The promotion cycle is ``promote``: under the job lock, verify what needs it and record each
verdict, move the pointer, and apply retention where asked; nothing is deleted when the promotion
was refused. Its callers hand in how the steps run (``Steps``: ``Here``, in this process, for the
CLI; the flow's Prefect tasks, tasks.checkpoint.flow_tasks.PrefectSteps) and how long to wait for a
save still being written (``Waiting``). Every verdict ckptops records is recorded under the job lock
``recording`` takes.

Rules the pointer obeys:
- it names only a checkpoint whose manifest says valid for the save now on disk, re-read under
  the lock just before the write; if none is left, the pointer is removed rather than left
  naming a failed checkpoint;
- it never moves backwards on its own, except away from a checkpoint that re-verification has
  since found invalid (or that was deleted or re-saved);
- an operator may name an older valid iteration (``--iteration N``, a rollback). That sets a
  hold: the newer checkpoints rolled back from are not promoted again by the next scheduled run;
  only checkpoints verified after the rollback may move the pointer past N;
- nothing others can write is trusted (``access``): if the save directory, the checkpoint, its
  manifest, a data file a resume reads, the pointer, the verdict log or Megatron's tracker is
  group- or world-writable or another user's, the run changes nothing (pointer, hold, log) and
  reports each such path; it fails;
- a manifest older than the newest verdict recorded for its checkpoint (``verdicts``) is not
  trusted, so re-verification that found a checkpoint invalid cannot be undone by putting its
  old manifest and signature back; and a checkpoint verified before the one preceding it had
  its lineage judged again once that one was (``verify.rejudge_lineage``).
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol

from tasks.checkpoint import layout
from tasks.checkpoint.access import unsafe_for_promotion
from tasks.checkpoint.catalog import CheckpointInfo, catalog, describe, resumable
from tasks.checkpoint.lock import Held, job_lock
from tasks.checkpoint.manifest import CorruptManifest, valid_for_this_save
from tasks.checkpoint.pointer import (
    Hold,
    clear_hold,
    clear_pointer,
    last_logged,
    read_hold,
    read_pointer,
    record_promotion,
    write_hold,
    write_pointer,
)
from tasks.checkpoint.prescan import wait_and_verify
from tasks.checkpoint.retention import RetentionPlan, apply_retention
from tasks.checkpoint.signing import Trust
from tasks.checkpoint.state import Completeness, State, VerifyOptions, wait_until_complete
from tasks.checkpoint.verify import Verification, verify_and_record
from tasks.errors import CkptopsError, UsageError


@dataclass
class PromotionReport:
    previous: int | None
    current: int | None
    message: str
    verifications: list[Verification] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # paths others can write: nothing was changed
    retention: RetentionPlan | None = None  # None: retention was not applied
    deleted: list[int] = field(default_factory=list)  # by retention

    @property
    def changed(self) -> bool:
        return self.previous != self.current

    @property
    def cleared(self) -> bool:
        """The pointer was removed: nothing valid is left to resume from."""
        return self.previous is not None and self.current is None

    @property
    def invalid(self) -> list[Verification]:
        return [v for v in self.verifications if v.state is State.INVALID]

    @property
    def in_progress(self) -> list[Verification]:
        return [v for v in self.verifications if v.state is State.IN_PROGRESS]

    @property
    def ok(self) -> bool:
        """Nothing verified failed, nothing was refused, and a checkpoint is still there to resume from."""
        return not self.invalid and not self.cleared and not self.refused

    def problems(self) -> list[str]:
        """Why the run is not ok, one line each."""
        lines = [v.line() for v in self.invalid] + [f"not promoted: {line}" for line in self.refused]
        return lines + ([f"pointer removed: {self.message}"] if self.cleared else [])

    def summary(self) -> str:
        """One line for a run that is ok: what was verified, where the pointer is, what went."""
        done = [str(v.iteration) for v in self.verifications if v.state is State.VALID]
        waiting = [str(v.iteration) for v in self.in_progress]
        return "".join(
            [
                f"verified {', '.join(done)}; " if done else "",
                f"latest verified: {'none' if self.current is None else self.current} ({self.message})",
                f"; retention deleted {', '.join(map(str, self.deleted))}" if self.deleted else "",
                f"; still in progress: {', '.join(waiting)}" if waiting else "",
                f"; refused: {'; '.join(self.refused)}" if self.refused else "",
            ]
        )


def _needs_verifying(info: CheckpointInfo, pointer: int | None) -> bool:
    if info.stale:
        return True  # re-saved since its manifest was written: whatever it said is void
    # The promoted checkpoint itself too: if its manifest is gone it must be checked again.
    current_or_newer = pointer is None or info.iteration >= pointer
    return current_or_newer and info.state in (State.UNVERIFIED, State.IN_PROGRESS)


def pending(save_dir: Path, options: VerifyOptions) -> list[int]:
    """Checkpoints to verify, oldest first: those never verified (or still being saved) from
    the pointer on, and any re-saved since verification."""
    pointer = read_pointer(save_dir)
    return [info.iteration for info in catalog(save_dir, options) if _needs_verifying(info, pointer)]


def _todo(save_dir: Path, options: VerifyOptions, requested: int | None) -> list[int]:
    """What to verify: what ``pending`` names, or only ``requested`` if it needs it."""
    if requested is None:
        return pending(save_dir, options)
    directory = save_dir / layout.iter_dir_name(requested)
    return [requested] if directory.is_dir() and _needs_verifying(describe(directory, options), None) else []


@dataclass(frozen=True)
class Waiting:
    """How long to wait for a checkpoint still being saved before it is verified, and how often to
    look; without it, a checkpoint still being saved is skipped (the next run picks it up)."""

    timeout_seconds: float
    poll_seconds: float


class Steps(Protocol):
    """How the promotion cycle's steps run: ``Here``, in this process, or as the flow's Prefect
    tasks (tasks.checkpoint.flow_tasks.PrefectSteps). ``verify`` records the verdict under
    ``held``, the job lock; with ``waiting`` it waits for the save first."""

    def wait(
        self, save_dir: Path, iteration: int, options: VerifyOptions, waiting: Waiting
    ) -> Completeness: ...

    def verify(
        self, save_dir: Path, iteration: int, options: VerifyOptions, held: Held, waiting: Waiting | None
    ) -> Verification: ...

    def promote(self, save_dir: Path, options: VerifyOptions, requested: int | None) -> PromotionReport: ...

    def retain(
        self, save_dir: Path, options: VerifyOptions, keep_verified: int
    ) -> tuple[RetentionPlan, list[int]]: ...


@dataclass(frozen=True)
class Here:
    """The cycle's steps in this process: ``progress`` is told the bytes each verification reads,
    ``watch`` the Slurm engine's shard table and news."""

    progress: Callable[[int], None] | None = None
    watch: Callable | None = None

    def wait(self, save_dir: Path, iteration: int, options: VerifyOptions, waiting: Waiting) -> Completeness:
        directory = save_dir / layout.iter_dir_name(iteration)
        return wait_until_complete(directory, options, waiting.timeout_seconds, waiting.poll_seconds)

    def verify(
        self, save_dir: Path, iteration: int, options: VerifyOptions, held: Held, waiting: Waiting | None
    ) -> Verification:
        """Verify and record the verdict; with ``waiting``, wait for the save first, reading its data
        files as they settle (``verify.overlap_save``)."""
        directory = save_dir / layout.iter_dir_name(iteration)
        if waiting is None or not waiting.timeout_seconds:
            return verify_and_record(directory, options, held, self.progress, watch=self.watch)
        return wait_and_verify(
            directory, options, held, waiting.timeout_seconds, waiting.poll_seconds, self.progress, self.watch
        )

    def promote(self, save_dir: Path, options: VerifyOptions, requested: int | None) -> PromotionReport:
        return apply_promotion(save_dir, options, requested)

    def retain(
        self, save_dir: Path, options: VerifyOptions, keep_verified: int
    ) -> tuple[RetentionPlan, list[int]]:
        return apply_retention(save_dir, options, keep_verified)


@dataclass(frozen=True)
class Recorder:
    """A save directory under its job lock (what ``recording`` yields): its checkpoints verified,
    and the verdicts recorded, by ``steps``."""

    save_dir: Path
    held: Held
    steps: Steps

    def verify(self, iteration: int, options: VerifyOptions, waiting: Waiting | None = None) -> Verification:
        return self.steps.verify(self.save_dir, iteration, options, self.held, waiting)


@contextmanager
def recording(save_dir: Path, lock_timeout_seconds: float, steps: Steps | None = None) -> Iterator[Recorder]:
    """Hold the job lock of ``save_dir`` (LockTimeout naming the holder after the timeout) and
    yield the ``Recorder`` that verifies its checkpoints and records the verdicts: the one way a
    verdict is recorded (a promotion re-reads manifests under the lock, and retention may be
    removing the very checkpoint)."""
    save_dir = Path(save_dir)
    with job_lock(save_dir, lock_timeout_seconds) as held:
        yield Recorder(save_dir, held, steps or Here())


def verify_pending(
    recorder: Recorder,
    options: VerifyOptions,
    requested: int | None,
    waiting: Waiting | None = None,
    on_verified: Callable[[Verification], None] | None = None,
) -> list[Verification]:
    """Verify what needs it (only ``requested``, if given), oldest first, recording each verdict.
    With ``waiting``, a checkpoint still being saved is waited for: inside the verify step with
    ``verify.overlap_save`` (it reads the data files as they settle), else before it; one still
    in progress after the wait is skipped. ``on_verified`` is told each verdict as it comes."""
    save_dir, steps = recorder.save_dir, recorder.steps
    overlap = waiting is not None and options.overlap_save
    results = []
    for iteration in _todo(save_dir, options, requested):
        if waiting is not None and not overlap:
            done = steps.wait(save_dir, iteration, options, waiting)
            if done.state is State.IN_PROGRESS:
                directory = save_dir / layout.iter_dir_name(iteration)
                results.append(Verification(directory, iteration, State.IN_PROGRESS, done.reason))
                continue
        result = recorder.verify(iteration, options, waiting if overlap else None)
        # A later checkpoint judged again against this one (``verify.rejudge_lineage``) is
        # reported as verified: found invalid, the run fails naming it.
        for found in (result, *result.rejudged):
            results.append(found)
            if on_verified:
                on_verified(found)
    return results


def _verified_since(info: CheckpointInfo, hold: Hold) -> bool:
    return info.verified_at is not None and datetime.fromisoformat(info.verified_at) > hold.since


def choose_target(
    save_dir: Path, options: VerifyOptions, requested: int | None = None, listings: dict | None = None
) -> tuple[int | None, str]:
    """The iteration the pointer should name (None: no valid checkpoint left), and why
    (``listings``: as ``catalog`` fills it)."""
    pointer = read_pointer(save_dir)
    infos = {i.iteration: i for i in catalog(save_dir, options, listings=listings)}
    valid = {info.iteration: info for info in resumable(list(infos.values()))}
    if requested is not None:
        info = infos.get(requested)
        if info is None:
            raise UsageError(f"--iteration {requested}: no such checkpoint in {save_dir}")
        if requested not in valid:
            raise CkptopsError(
                f"{layout.iter_dir_name(requested)}: not promotable, it is {info.state} ({info.reason})"
            )
        return requested, "requested by the operator"
    hold = read_hold(save_dir)
    eligible = sorted(
        i for i, info in valid.items() if hold is None or i <= hold.iteration or _verified_since(info, hold)
    )
    if pointer is not None and pointer not in valid:
        current = infos.get(pointer)
        why = "its directory is gone" if current is None else f"it is now {current.state}: {current.reason}"
        if not eligible:
            return (
                None,
                f"no valid checkpoint left: {layout.iter_dir_name(pointer)} {why.removeprefix('it ')}",
            )
        return eligible[-1], f"moved off {layout.iter_dir_name(pointer)} because {why}"
    if not eligible:
        return pointer, "no verified checkpoint to promote"
    newest = eligible[-1]
    if pointer is None:
        return newest, "first promotion"
    if newest > pointer:
        return newest, "newer checkpoint verified"
    held = hold is not None and any(i > pointer for i in valid)
    return (
        pointer,
        f"held at {hold.iteration} by an operator's rollback" if held else "already the newest verified",
    )


def point_to(save_dir: Path, iteration: int, trust: Trust) -> None:
    """Write the pointer after re-reading the manifest (as ``trust`` asks): the last line of
    defence."""
    directory = Path(save_dir) / layout.iter_dir_name(iteration)
    if valid_for_this_save(directory, iteration, trust) is None:
        raise CkptopsError(
            f"{directory.name}: refusing to promote, its manifest does not say valid for this save"
        )
    write_pointer(save_dir, iteration)


def apply_promotion(save_dir: Path, options: VerifyOptions, requested: int | None = None) -> PromotionReport:
    """Move the pointer (the caller holds the job lock); the report says from where to where and
    why (the caller adds the verifications it ran). If others can write what the move would
    trust, nothing is changed, not even the log, and the report lists each such path."""
    save_dir = Path(save_dir)
    previous = read_pointer(save_dir)
    listings: dict = {}
    target, why = choose_target(save_dir, options, requested, listings)
    refused = unsafe_for_promotion(
        save_dir, target, options.job_user, options.allow_group_write, listings.get(target)
    )
    if refused:
        what = "nothing promoted" if target is None else f"{layout.iter_dir_name(target)} not promoted"
        return PromotionReport(
            previous,
            previous,
            f"{what}: others can write {len(refused)} of the paths it trusts",
            refused=refused,
        )
    _reconcile_log(save_dir, previous)
    changed = False
    if target is None:
        if previous is not None:
            clear_pointer(save_dir)
            changed = True
    elif target != previous:
        point_to(save_dir, target, options.trust)
        changed = True
    if requested is not None:
        rolled_back = any(
            i.iteration > requested and i.state is State.VALID for i in catalog(save_dir, options)
        )
        if rolled_back:
            write_hold(save_dir, requested)
        else:
            clear_hold(save_dir)
    elif target is not None and (hold := read_hold(save_dir)) is not None and target > hold.iteration:
        clear_hold(save_dir)
    if changed:  # after the hold: the log is a record, and must never cost a rollback its hold
        why = _log(save_dir, target, previous, why)
    return PromotionReport(previous, target, why)


def _log(save_dir: Path, target: int | None, previous: int | None, why: str, gap: bool = False) -> str:
    """Append to the promotion log; a failure is reported in ``why``, not raised (the pointer
    has moved already, and the next run reconciles the log with it)."""
    try:
        record_promotion(save_dir, target, previous, why, gap)
    except OSError as e:
        return f"{why} (promotion log not written: {e}; the next run records it)"
    return why


def _reconcile_log(save_dir: Path, pointer: int | None) -> None:
    """A crash (or a full disk) between the pointer write and the log append leaves the log
    behind the pointer: record the change as happened at an unknown time since the last entry."""
    logged, value = last_logged(save_dir)
    if logged and value != pointer:
        _log(
            save_dir,
            pointer,
            value,
            "found unlogged: changed at an unknown time since the entry before",
            gap=True,
        )


def promote(
    save_dir: Path,
    options: VerifyOptions,
    lock_timeout_seconds: float,
    requested: int | None = None,
    *,
    steps: Steps | None = None,
    waiting: Waiting | None = None,
    keep_verified: int | None = None,
    on_verified: Callable[[Verification], None] | None = None,
) -> PromotionReport:
    """The promotion cycle, under the job lock: verify the pending checkpoints (or the requested
    one) oldest first and record each verdict, move the pointer (to ``requested``, if given), and
    with ``keep_verified`` apply retention unless the promotion was refused. ``steps``: how each
    step runs (``Here`` if not given); ``waiting``: whether and how long to wait for a save still
    being written; ``on_verified``: told each verdict as it comes. The report says it all."""
    with recording(save_dir, lock_timeout_seconds, steps) as recorder:
        verifications = verify_pending(recorder, options, requested, waiting, on_verified)
        return _promote_and_retain(recorder, options, requested, verifications, keep_verified)


def _promote_and_retain(
    recorder: Recorder,
    options: VerifyOptions,
    requested: int | None,
    verifications: list[Verification],
    keep_verified: int | None,
) -> PromotionReport:
    """Move the pointer and, with ``keep_verified``, apply retention (a refused promotion, where
    others can write what it trusts, deletes nothing); the report, with the ``verifications``."""
    save_dir, steps = recorder.save_dir, recorder.steps
    report = steps.promote(save_dir, options, requested)
    report.verifications = verifications
    if keep_verified is not None and not report.refused:
        report.retention, report.deleted = steps.retain(save_dir, options, keep_verified)
    return report


def _identity_only(directory: Path, iteration: int, trust: Trust) -> Verification:
    """The save's identity compared with its manifest (which must be trusted: signed, where the
    profile asks), without reading the data."""
    try:
        if valid_for_this_save(directory, iteration, trust) is not None:
            return Verification(directory, iteration, State.VALID, "the manifest matches the save on disk")
        why = f"{layout.MANIFEST}: does not say valid for the save on disk"
    except CorruptManifest as e:
        why = str(e)
    return Verification(directory, iteration, State.INVALID, why)


@dataclass(frozen=True)
class IdentityOnly(Here):
    """``Here``, except that a verification compares only the save's identity (the sizes and times
    of its files) with its manifest, without reading the data, and records nothing."""

    def verify(
        self, save_dir: Path, iteration: int, options: VerifyOptions, held: Held, waiting: Waiting | None
    ) -> Verification:
        return _identity_only(save_dir / layout.iter_dir_name(iteration), iteration, options.trust)


def reverify(
    save_dir: Path,
    options: VerifyOptions,
    iteration: int,
    lock_timeout_seconds: float,
    full: bool = True,
) -> tuple[Verification, PromotionReport]:
    """Verify a verified checkpoint again before something uses it (a relaunch reads every byte,
    and ``torch.load`` checks no CRC), then promote as a scheduled run would: a checkpoint that
    fails is recorded invalid in its manifest and the pointer moves off it. ``full`` reads every
    byte against the manifest with the profile's engine; otherwise only the save's identity (the
    sizes and times of its files) is compared with the manifest."""
    with recording(save_dir, lock_timeout_seconds, Here() if full else IdentityOnly()) as recorder:
        result = recorder.verify(iteration, options)
        return result, _promote_and_retain(recorder, options, None, [result], None)
