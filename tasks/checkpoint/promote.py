"""Promotion: verify the new complete checkpoints, then point at the newest that passed.

Rules the pointer obeys:
- it names only a checkpoint whose manifest says valid, re-read under the lock just before the
  write;
- it never moves backwards on its own (a slower, older run finishing late must not undo a newer
  promotion), except away from a checkpoint that re-verification has since found invalid;
- an operator may name an older valid iteration explicitly (``--iteration N``).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.catalog import UNVERIFIED, catalog
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.pointer import read_pointer, write_pointer
from tasks.checkpoint.state import State, VerifyOptions, completeness
from tasks.checkpoint.verify import Verification, verify_checkpoint
from tasks.errors import CkptopsError


@dataclass
class PromotionReport:
    previous: int | None
    current: int | None
    message: str
    verifications: list[Verification] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.previous != self.current

    @property
    def failed(self) -> list[Verification]:
        return [v for v in self.verifications if v.state is State.INVALID]

    @property
    def in_progress(self) -> list[Verification]:
        return [v for v in self.verifications if v.state is State.IN_PROGRESS]


def pending(save_dir: Path, options: VerifyOptions) -> list[int]:
    """Checkpoints never verified, newer than the pointer, oldest first (in-progress included:
    the caller decides whether to wait for them)."""
    pointer = read_pointer(save_dir)
    return [
        info.iteration
        for info in catalog(save_dir, options)
        if info.state in (UNVERIFIED, State.IN_PROGRESS.value)
        and (pointer is None or info.iteration > pointer)
    ]


def wait_until_complete(directory: Path, options: VerifyOptions, timeout_seconds: float,
                        poll_seconds: float) -> tuple[State | None, str]:
    """Poll a checkpoint's completeness until it is done saving or the timeout passes."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        state, why = completeness(directory, options)
        if state is not State.IN_PROGRESS or time.monotonic() >= deadline:
            return state, why
        time.sleep(min(poll_seconds, max(0.0, deadline - time.monotonic())))


def choose_target(save_dir: Path, options: VerifyOptions, requested: int | None = None) -> tuple[int | None, str]:
    """The iteration the pointer should name, and why."""
    pointer = read_pointer(save_dir)
    infos = {i.iteration: i for i in catalog(save_dir, options)}
    valid = sorted(i for i, info in infos.items() if info.state == State.VALID.value)
    if requested is not None:
        info = infos.get(requested)
        if info is None:
            raise CkptopsError(f"{layout.iter_dir_name(requested)}: no such checkpoint in {save_dir}")
        if info.state != State.VALID.value:
            raise CkptopsError(f"{layout.iter_dir_name(requested)}: not promotable, it is {info.state} ({info.reason})")
        return requested, "requested by the operator"
    if not valid:
        return pointer, "no verified checkpoint to promote"
    newest = valid[-1]
    if pointer is None:
        return newest, "first promotion"
    current = infos.get(pointer)
    if current is None or current.state != State.VALID.value:
        why = "its directory is gone" if current is None else f"it is now {current.state}: {current.reason}"
        return newest, f"moved off {layout.iter_dir_name(pointer)} because {why}"
    if newest > pointer:
        return newest, "newer checkpoint verified"
    return pointer, "already the newest verified"


def point_to(save_dir: Path, iteration: int) -> None:
    """Write the pointer after re-reading the manifest: the last line of defence."""
    manifest = read_manifest(Path(save_dir) / layout.iter_dir_name(iteration))
    if manifest is None or not manifest.valid:
        raise CkptopsError(f"{layout.iter_dir_name(iteration)}: refusing to promote, manifest is not valid")
    write_pointer(save_dir, iteration)


def promote(save_dir: Path, options: VerifyOptions, lock_timeout_seconds: float,
            requested: int | None = None, progress: Callable[[int], None] | None = None,
            on_verified: Callable[[Verification], None] | None = None) -> PromotionReport:
    """Verify pending checkpoints (or the requested one) oldest first, then promote."""
    save_dir = Path(save_dir)
    with job_lock(save_dir, lock_timeout_seconds):
        previous = read_pointer(save_dir)
        if requested is not None:
            todo = [requested] if read_manifest(save_dir / layout.iter_dir_name(requested)) is None else []
        else:
            todo = pending(save_dir, options)
        verifications = []
        for iteration in todo:
            result = verify_checkpoint(save_dir / layout.iter_dir_name(iteration), options, progress)
            verifications.append(result)
            if on_verified:
                on_verified(result)
        target, why = choose_target(save_dir, options, requested)
        if target is not None and target != previous:
            point_to(save_dir, target)
        return PromotionReport(previous, target, why, verifications)
