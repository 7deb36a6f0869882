"""Retention: keep the newest K verified checkpoints, delete older ones, never anything at risk.

Never deleted: the promoted checkpoint, anything newer than it (it may still be saving or
waiting for verification), anything pinned, anything not verified valid. A failed checkpoint is
kept and reported: it is evidence, and deleting it is a human decision. Nothing at all is deleted
before a first promotion. Deletion runs apart from verification and under the job lock, and each
checkpoint disappears atomically (rename, then delete) so no reader sees half of one.

A delete a crash cut short leaves a ``.ckptops-trash-*`` folder; the next run finishes only those
its own trash record proves it made (``purge_trash``): a folder of that name ckptops did not
record, a user's among them, is left alone and named once in a warning.
"""

from dataclasses import dataclass, field
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.catalog import CheckpointInfo, catalog
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.pins import pins as read_pins
from tasks.checkpoint.pins import remove_expired_leases
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.state import State, VerifyOptions
from tasks.storage.local import purge_trash, remove_tree


@dataclass
class RetentionPlan:
    keep_verified: int
    pointer: int | None
    delete: list[int] = field(default_factory=list)
    kept: dict[int, str] = field(default_factory=dict)
    invalid: list[int] = field(default_factory=list)  # kept for inspection
    expired_leases: list[str] = field(default_factory=list)  # removed: their readers are gone


def plan_retention(infos: list[CheckpointInfo], pointer: int | None, keep_verified: int) -> RetentionPlan:
    """Pure decision from the catalog: which iterations go, and why each other one stays."""
    if keep_verified < 2:
        raise ValueError("keep_verified must be at least 2")
    plan = RetentionPlan(keep_verified, pointer)
    valid = sorted((i.iteration for i in infos if i.state is State.VALID), reverse=True)
    newest_valid = set(valid[:keep_verified])
    for info in infos:
        it = info.iteration
        if info.state is State.INVALID:
            plan.kept[it] = f"{info.state}: {info.reason}"
            plan.invalid.append(it)
        elif info.state is not State.VALID:
            plan.kept[it] = f"{info.state}: {info.reason}"
        elif pointer is None:
            plan.kept[it] = "nothing promoted yet"
        elif it == pointer:
            plan.kept[it] = "promoted"
        elif it > pointer:
            plan.kept[it] = "newer than the promoted checkpoint"
        elif info.pins:
            plan.kept[it] = f"pinned by {', '.join(info.pins)}"
        elif it in newest_valid:
            plan.kept[it] = f"among the newest {keep_verified} verified"
        else:
            plan.delete.append(it)
    return plan


def apply_retention(
    save_dir: Path, options: VerifyOptions, keep_verified: int, dry_run: bool = False
) -> tuple[RetentionPlan, list[int]]:
    """Plan, then delete (the caller holds the job lock). Pins and the pointer are re-read
    before each delete: a drill may have pinned a checkpoint since the plan was made."""
    save_dir = Path(save_dir)
    plan = plan_retention(catalog(save_dir, options), read_pointer(save_dir), keep_verified)
    if dry_run:
        return plan, []
    plan.expired_leases = remove_expired_leases(save_dir)
    purge_trash(save_dir)
    deleted = []
    for iteration in list(plan.delete):
        if iteration in read_pins(save_dir) or iteration == read_pointer(save_dir):
            plan.kept[iteration] = "pinned or promoted since planning"
            plan.delete.remove(iteration)
            continue
        remove_tree(save_dir / layout.iter_dir_name(iteration))
        deleted.append(iteration)
    return plan, deleted


def retain(
    save_dir: Path,
    options: VerifyOptions,
    keep_verified: int,
    lock_timeout_seconds: float,
    dry_run: bool = False,
) -> tuple[RetentionPlan, list[int]]:
    with job_lock(save_dir, lock_timeout_seconds):
        return apply_retention(save_dir, options, keep_verified, dry_run)
