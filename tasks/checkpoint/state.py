"""A checkpoint's state as far as a stat can tell: is the save finished, still running, or dead?

Kept apart from verification, which reads every byte, so that listing a save directory (status,
retention, promotion decisions) stays cheap and does not import torch.
"""

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from tasks.checkpoint import dialect, layout
from tasks.checkpoint.signing import Trust
from tasks.errors import CkptopsError, unreadable
from tasks.storage.bounded import load_json, read_bounded
from tasks.storage.digest import PROFILE_NAMES, Hashing
from tasks.storage.local import list_files

# Shards are written by many hosts and metadata.json by rank 0: tolerate this much clock skew
# before calling a shard "newer than metadata.json". A real re-save comes an interval later.
CLOCK_SKEW_NS = 5_000_000_000
# The most of a young metadata.json or integrity.json read to see whether it is whole yet: an
# integrity.json lists every file with a digest, about 400 bytes each (5,120 files: 2 MB).
_YOUNG_JSON_LIMIT = 16 << 20


class State(StrEnum):
    VALID = "valid"
    INVALID = "invalid"
    IN_PROGRESS = "in-progress"
    UNVERIFIED = "unverified"  # the catalog's: a finished save nobody has verified yet


@dataclass(frozen=True)
class VerifyOptions:
    job: str
    megatron_core_version: str | None = None
    writes_integrity_json: bool = False
    abandon_after_seconds: float = 6 * 3600
    settle_seconds: float = 30.0
    threads: int = 0
    layout: tuple[int, int, int] | None = None  # (tensor, pipeline, data) parallel, if known
    hashing: Hashing = Hashing()  # the algorithm and segment size of new manifests' hashes
    engine: str = "local"  # or "slurm": the bytes are read by shard tasks on nodes (slurm_engine)
    slurm: object = None  # the profile's verify.slurm section, for the slurm engine
    overlap_save: bool = False  # read data files while the save still writes others (prescan)
    frozen: tuple[str, ...] = ()  # parameters meant to stay frozen (patterns): not stale
    drift_factor: float = 10.0  # a weight's norm moving more than this is a warning
    job_user: str | None = None  # owner trusted besides root and us; None: the save dir's (access)
    allow_group_write: bool = False  # a group-writable save dir, manifest or pointer is trusted
    trust: Trust = field(default_factory=Trust)  # who may sign its manifests (none: unchecked)

    @classmethod
    def from_profile(cls, profile, save_dir: Path | None = None, **overrides) -> "VerifyOptions":
        """Options for a save directory; the profile's job settings apply only to its own save_dir."""
        own = save_dir is None or Path(save_dir).resolve() == profile.job.save_dir.resolve()
        job_layout = profile.job.layout
        settings = dict(
            job=profile.job.name if own else Path(save_dir).resolve().name,
            megatron_core_version=profile.job.megatron_core_version if own else None,
            writes_integrity_json=profile.job.writes_integrity_json if own else False,
            abandon_after_seconds=profile.verify.abandon_after_seconds,
            settle_seconds=profile.verify.settle_seconds,
            threads=profile.verify.threads,
            hashing=Hashing(PROFILE_NAMES[profile.verify.digest], profile.verify.segment_mb << 20),
            engine=profile.verify.engine,
            slurm=profile.verify.slurm,
            overlap_save=profile.verify.overlap_save,
            frozen=tuple(profile.verify.frozen),
            drift_factor=profile.verify.drift_factor,
            job_user=profile.job.user if own else None,
            allow_group_write=profile.verify.allow_group_write,
            trust=Trust.of(profile, save_dir),
            layout=(job_layout.tensor_parallel, job_layout.pipeline_parallel, job_layout.data_parallel)
            if own
            else None,
        )
        return cls(**(settings | overrides))


@dataclass(frozen=True)
class Completeness:
    """``state`` is None when the save has finished and the checkpoint can be checked."""

    state: State | None
    file: str | None = None
    detail: str = ""

    @property
    def reason(self) -> str:
        return f"{self.file}: {self.detail}" if self.file else self.detail


def _newer_checkpoint_complete(directory: Path) -> bool:
    """A later iteration finished saving, so this one never will (Megatron saves in order)."""
    iteration = layout.parse_iter_dir(directory.name)
    parent = directory.parent
    return any(
        (parent / layout.iter_dir_name(i) / layout.METADATA_JSON).exists()
        for i in layout.list_iterations(parent)
        if i > iteration
    )


def _parses(path: Path) -> bool:
    """Whether a young ``metadata.json`` or ``integrity.json`` is whole JSON yet: read bounded,
    a link or FIFO not opened (verification names what is wrong once it has settled)."""
    try:
        data = read_bounded(path, _YOUNG_JSON_LIMIT, path.name, follow=False)
        return isinstance(load_json(data, path, path.name), dict)
    except CkptopsError:
        return False


def _idle_seconds(directory: Path, files: dict[str, os.stat_result]) -> float:
    """How long since the save last wrote into ``directory``: ckptops's own files (a manifest
    written into a save that failed) are not the save's, and never make it look active."""
    times = [st.st_mtime for name, st in files.items() if not layout.is_own_file(name)]
    return time.time() - max(times, default=directory.stat().st_mtime)


def completeness(
    directory: Path, options: VerifyOptions, files: dict[str, os.stat_result] | None = None
) -> Completeness:
    """Cheap (stat, and a parse of two tiny JSON files): in progress, abandoned, or finished.
    ``files``: the directory's listing (``list_files``) when the caller has just taken it."""
    directory = Path(directory)
    try:
        files = list_files(directory) if files is None else files
        idle = _idle_seconds(directory, files)
        if layout.METADATA_JSON not in files:
            if _newer_checkpoint_complete(directory):
                return Completeness(
                    State.INVALID, layout.METADATA_JSON, "missing, and a newer checkpoint finished saving"
                )
            if idle > options.abandon_after_seconds:
                return Completeness(
                    State.INVALID, layout.METADATA_JSON, f"missing, no change for {idle:.0f}s"
                )
            return Completeness(State.IN_PROGRESS, layout.METADATA_JSON, "not written yet")
        finished = files[layout.METADATA_JSON].st_mtime_ns + CLOCK_SKEW_NS
        newer = sorted(
            n for n, st in files.items() if st.st_mtime_ns > finished and n.endswith(layout.DATA_SUFFIX)
        )
        # Megatron re-saving into an existing directory leaves the old metadata.json visible
        # while new shards are written. Only while they keep changing: shards modified after the
        # save and then left alone are judged by their bytes, not waited for forever.
        if newer and idle <= options.abandon_after_seconds:
            return Completeness(
                State.IN_PROGRESS, newer[0], f"newer than {layout.METADATA_JSON} (being re-saved)"
            )
        # Megatron writes metadata.json and integrity.json with a plain open('w'): a file that
        # does not parse yet may still be being written. Judged once it has settled.
        for name in (layout.METADATA_JSON, layout.INTEGRITY_JSON):
            young = name in files and time.time() - files[name].st_mtime < options.settle_seconds
            if young and not _parses(directory / name):
                return Completeness(State.IN_PROGRESS, name, "still being written")
    except FileNotFoundError:
        return Completeness(State.IN_PROGRESS, None, "directory changed while being listed")
    except OSError as e:
        raise unreadable(directory, e) from None
    if options.writes_integrity_json and layout.INTEGRITY_JSON not in files:
        return Completeness(State.IN_PROGRESS, layout.INTEGRITY_JSON, "not written yet")
    return _bridge_finishing(directory, files, idle, options)


def _bridge_finishing(directory: Path, files: dict, idle: float, options: VerifyOptions) -> Completeness:
    """Megatron-Bridge writes train_state.pt, its resume pointer, run_config.yaml and tokenizer/
    after the shards and metadata.json: while they are missing and the save may still be
    finishing, it is in progress. Once it cannot be (abandoned, or a newer checkpoint finished),
    verification judges it and names what is missing."""
    if dialect.dialect_of(directory) != dialect.BRIDGE:
        return Completeness(None)
    lacking = [n for n in (dialect.TRAIN_STATE, dialect.RUN_CONFIG) if n not in files]
    if not lacking and _tokenizer_awaited(directory):
        lacking = [f"{dialect.TOKENIZER}/"]
    if lacking and idle <= options.abandon_after_seconds and not _newer_checkpoint_complete(directory):
        return Completeness(
            State.IN_PROGRESS, lacking[0], "not written yet (Megatron-Bridge writes it after the shards)"
        )
    return Completeness(None)


def _tokenizer_awaited(directory: Path) -> bool:
    """Bridge copies the tokenizer's files last (``shutil.copy2``, keeping the source's times):
    none there yet, where the run's config says it keeps them. The config is parsed only then:
    a listing is all a finished save costs."""
    if dialect.tokenizer_files(directory):
        return False
    try:
        return dialect.keeps_tokenizer(dialect.run_config(directory / dialect.RUN_CONFIG))
    except (OSError, ValueError, CkptopsError):
        return False  # verification names the unreadable config


def wait_until_complete(
    directory: Path,
    options: VerifyOptions,
    timeout_seconds: float,
    poll_seconds: float,
    while_waiting: Callable[[float], object] | None = None,
) -> Completeness:
    """Poll a checkpoint's completeness until its save is done or the timeout passes, calling
    ``while_waiting`` (the early reading of settled files, given the deadline) between polls."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        done = completeness(directory, options)
        if done.state is not State.IN_PROGRESS or time.monotonic() >= deadline:
            return done
        if while_waiting is not None:
            while_waiting(deadline)
        time.sleep(min(poll_seconds, max(0.0, deadline - time.monotonic())))
