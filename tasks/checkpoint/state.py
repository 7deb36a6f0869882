"""A checkpoint's state as far as a stat can tell: is the save finished, still running, or dead?

Kept apart from verification, which reads every byte, so that listing a save directory (status,
retention, promotion decisions) stays cheap and does not import torch.
"""

import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from tasks.checkpoint import layout


class State(StrEnum):
    VALID = "valid"
    INVALID = "invalid"
    IN_PROGRESS = "in-progress"


@dataclass(frozen=True)
class VerifyOptions:
    job: str
    megatron_core_version: str | None = None
    writes_integrity_json: bool = False
    abandon_after_seconds: float = 6 * 3600
    threads: int = 0
    write_manifest: bool = True

    @classmethod
    def from_profile(cls, profile, save_dir: Path | None = None, **overrides) -> "VerifyOptions":
        """Options for a save directory; the profile's job name applies only to its own save_dir."""
        own = save_dir is None or Path(save_dir).resolve() == profile.job.save_dir.resolve()
        return cls(
            job=profile.job.name if own else Path(save_dir).resolve().name,
            megatron_core_version=profile.job.megatron_core_version if own else None,
            writes_integrity_json=profile.job.writes_integrity_json if own else False,
            abandon_after_seconds=profile.verify.abandon_after_seconds,
            threads=profile.verify.threads,
            **overrides,
        )


def _newest_mtime(directory: Path) -> float:
    times = [p.stat().st_mtime for p in directory.iterdir() if p.is_file()]
    return max(times, default=directory.stat().st_mtime)


def _newer_checkpoint_complete(directory: Path) -> bool:
    """A later iteration finished saving, so this one never will (Megatron saves in order)."""
    iteration = layout.parse_iter_dir(directory.name)
    parent = directory.parent
    return any(
        (parent / layout.iter_dir_name(i) / layout.METADATA_JSON).exists()
        for i in layout.list_iterations(parent)
        if i > iteration
    )


def completeness(directory: Path, options: VerifyOptions) -> tuple[State | None, str]:
    """Cheap (stat only): ``(IN_PROGRESS, why)``, ``(INVALID, why)`` for an abandoned save, or
    ``(None, "")`` when the save has finished and the checkpoint can be checked."""
    metadata_json = directory / layout.METADATA_JSON
    if not metadata_json.exists():
        idle = time.time() - _newest_mtime(directory)
        if _newer_checkpoint_complete(directory):
            return State.INVALID, f"{layout.METADATA_JSON}: missing, and a newer checkpoint finished saving [complete]"
        if idle > options.abandon_after_seconds:
            return State.INVALID, f"{layout.METADATA_JSON}: missing, no change for {idle:.0f}s [complete]"
        return State.IN_PROGRESS, f"{layout.METADATA_JSON}: not written yet"
    finished = metadata_json.stat().st_mtime_ns
    newer = sorted(p.name for p in directory.glob(f"*{layout.DATA_SUFFIX}") if p.stat().st_mtime_ns > finished)
    # Megatron re-saving into an existing directory leaves the old metadata.json visible while
    # new shards are written. Only while they keep changing: shards modified after the save and
    # then left alone are judged by their bytes, not waited for forever.
    if newer and time.time() - _newest_mtime(directory) <= options.abandon_after_seconds:
        return State.IN_PROGRESS, f"{newer[0]}: newer than {layout.METADATA_JSON} (being re-saved)"
    if options.writes_integrity_json and not (directory / layout.INTEGRITY_JSON).exists():
        return State.IN_PROGRESS, f"{layout.INTEGRITY_JSON}: not written yet"
    return None, ""
