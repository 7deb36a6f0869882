"""Copy the promoted checkpoint to the archive, committing it the way object stores allow.

Object stores have no rename, so an archive entry is committed by its manifest, written last.
This module decides whether this run copies, and composes the phases, each in its own module:

    1. upload the data files (``upload``: parallel; multipart for large ones), skipping objects a
       killed earlier run already uploaded whole. On S3 one read of each file re-hashes it as its
       manifest does and computes the CRC64NVME sent with it (the store checks it on arrival);
    2. check the store's copy (``check``): on S3 the store's own full-object CRC64NVME and size of
       every object against those of the bytes that hashed as the manifest, and its encryption
       (``protect``); a rotating sample of copies and every copy on a local directory are also
       read back and hashed. A bad object is uploaded once more, then the copy gives up;
    3. on an Object Lock archive, lock the data objects (``protect``), then write
       ``<job>/iter_NNNNNNN/manifest.json`` (locked too): the commit marker (``commit``);
    4. update the archive's pointer object ``<job>/latest_committed_iteration.txt``;
    5. record the copy in the archive's own log beside the job (``history``; the shared-store
       manifest is the verifier's alone), then apply archive retention (``retention``).

Archive layout (``entries``): ``<archive url>/<job>/iter_NNNNNNN/{files..., manifest.json}``.
"""

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from tasks.archive.check import check_read_back, check_stored, reads_back, verified
from tasks.archive.commit import (
    commit,
    refuse_an_entry_nobody_could_read,
    uncommit_if_damaged,
    uncommit_unreadable,
)
from tasks.archive.entries import archived_manifest, by_commit_time, committed_iterations, entry_key
from tasks.archive.history import log_copy
from tasks.archive.protect import lock_objects
from tasks.archive.retention import apply_archive_retention
from tasks.archive.upload import upload_checked, upload_files
from tasks.checkpoint import layout
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.manifest import Manifest
from tasks.checkpoint.pins import pinned, pins
from tasks.checkpoint.pointer import Promoted, promoted, read_pointer
from tasks.checkpoint.signing import Trust
from tasks.errors import UsageError
from tasks.storage.archive import ArchiveStore
from tasks.storage.local import list_files


@dataclass
class ArchiveResult:
    iteration: int | None
    location: str | None
    committed: bool
    message: str
    uploaded_bytes: int = 0
    reused_bytes: int = 0
    seconds: float = 0.0
    deleted: list[int] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # why archive retention kept a copy it could drop
    read_back: bool = True  # the copy was read back in full (else checked by the store's checksums)

    @property
    def throughput_gbps(self) -> float:
        return self.uploaded_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def progress_total(save_dir: Path, settings=None) -> int:
    """What a copy's progress counts up to: the promoted checkpoint's bytes, twice when the copy
    is read back (each file is uploaded, then read back); 0 when nothing is promoted."""
    iteration = read_pointer(save_dir)
    if iteration is None:
        return 0
    times = 2 if settings is None or reads_back(save_dir, settings) else 1
    return times * sum(
        st.st_size for st in list_files(Path(save_dir) / layout.iter_dir_name(iteration)).values()
    )


def archive_checkpoint(
    save_dir: Path, profile, force: bool = False, progress: Callable[[int], None] | None = None
) -> ArchiveResult:
    """Copy the promoted checkpoint to the archive (once per period unless ``force``). A
    committed entry of the promoted iteration whose archived manifest cannot be read or trusted
    is kept for inspection, and replaced by a fresh copy with ``force``."""
    if profile.archive is None:
        raise UsageError(f"{profile.source}: no archive section")
    save_dir = Path(save_dir)
    job, trust = profile.job.name, Trust.of(profile)
    store = ArchiveStore.from_settings(profile.archive)
    with job_lock(save_dir, profile.verify.lock_timeout_seconds, name=layout.ARCHIVE_LOCK):
        found = promoted(save_dir, trust)
        iteration, location = found.iteration, store.where(entry_key(job, found.iteration))
        refuse_an_entry_nobody_could_read(found.manifest, trust)
        committed = committed_iterations(store, job)
        commit_times, unreadable = by_commit_time(store, job, committed, trust)
        if iteration in unreadable and not force:
            return ArchiveResult(
                iteration,
                location,
                False,
                f"iteration {iteration} is archived but its archived manifest is unreadable "
                f"({unreadable[iteration]}); kept for inspection: --force replaces it",
            )
        if iteration in unreadable:  # and --force: copied afresh
            damaged = uncommit_unreadable(store, job, iteration, committed, unreadable)
        else:
            damaged = uncommit_if_damaged(store, job, found.manifest, committed, trust)
        period = profile.archive.period_hours
        again = force or damaged is not None  # a damaged copy is copied again whatever the period
        why_not = _why_not(store, job, found.manifest, committed, commit_times, period, again, trust)
        if why_not:
            return ArchiveResult(iteration, location, False, why_not)
        started = time.monotonic()
        copied = _copy(store, job, save_dir, found, profile.archive, progress, trust)
        seconds = time.monotonic() - started
        log_copy(save_dir, iteration, copied.status)
        kept: list[str] = []
        deleted = apply_archive_retention(
            store, job, profile.archive.keep, profile.archive.keep_days, set(pins(save_dir)), kept, trust
        )
        return ArchiveResult(
            iteration,
            copied.status["url"],
            True,
            _committed_message(damaged, unreadable),
            copied.uploaded,
            copied.reused,
            seconds,
            deleted,
            kept,
            copied.read_back,
        )


def _why_not(
    store: ArchiveStore,
    job: str,
    manifest: Manifest,
    committed: list[int],
    commit_times: dict[int, dict],
    period_hours: float,
    force: bool,
    trust: Trust,
) -> str | None:
    """Why this run does not copy the promoted save: its copy is committed already, the newest
    copy is younger than the period (unless ``force``), or the same iteration is committed from
    an earlier save."""
    iteration = manifest.iteration
    if iteration in committed and archived_manifest(store, job, iteration, trust).files == manifest.files:
        return f"iteration {iteration} is already archived"
    if not force and commit_times:
        newest = list(commit_times)[-1]
        committed_at = datetime.fromisoformat(commit_times[newest]["committed_at"])
        age_hours = (datetime.now(UTC) - committed_at).total_seconds() / 3600
        if age_hours < period_hours:
            return (
                f"the newest archive copy (iteration {newest}) is {age_hours:.1f} h old, "
                f"the period is {period_hours:g} h"
            )
    if iteration in committed:
        # The same iteration with other bytes (Megatron re-saved it after a rollback). Its
        # committed copy may be the only one: never overwrite it; the next promotion archives.
        return (
            f"iteration {iteration} is already archived from an earlier save; its committed "
            "copy is kept, the next promoted iteration will be archived"
        )
    return None


@dataclass
class _Copied:
    status: dict  # the archive status the committed manifest holds
    uploaded: int
    reused: int
    read_back: bool


def _copy(
    store: ArchiveStore, job: str, save_dir: Path, found: Promoted, settings, progress, trust: Trust
) -> _Copied:
    """Upload, check, lock and commit the promoted save, pinned while it is read."""
    if settings.object_lock is not None:
        store.check_object_lock()
    read_back = reads_back(save_dir, settings)
    with pinned(save_dir, found.iteration, f"archive-{os.getpid()}", "archive copy reading"):
        uploaded, reused, checked = _upload_and_check(store, job, found, read_back, settings, progress)
        lock_until = None
        if settings.object_lock is not None:
            lock_until, checked["object_lock"] = lock_objects(
                store, job, found.manifest, settings.object_lock
            )
        status = commit(store, job, found.manifest, found.directory, checked, lock_until, trust)
    return _Copied(status, uploaded, reused, checked["read_back"])


def _upload_and_check(
    store: ArchiveStore, job: str, found: Promoted, read_back: bool, settings, progress
) -> tuple[int, int, dict]:
    """Upload the files and check the store's copy; returns (bytes uploaded, bytes reused, what
    the checks found, for the archive status)."""
    directory, manifest = found.directory, found.manifest
    if store.is_local:
        uploaded, reused = upload_files(store, job, directory, manifest, progress)
        checked = {"read_back": True}
    else:
        sent, uploaded, reused = upload_checked(store, job, directory, manifest, progress)
        checked, again = check_stored(store, job, directory, manifest, sent, progress)
        uploaded += again
        # A store that keeps no checksums proves nothing by them: read this copy back.
        read_back = read_back or checked["checksum"] != "CRC64NVME"
    if read_back:
        check_read_back(store, job, directory, manifest, progress)
    checked["verified"] = verified(
        store, manifest, read_back, settings.readback_fraction, checked.get("checksum")
    )
    checked["read_back"] = read_back
    return uploaded, reused, checked


def _committed_message(damaged: str | None, unreadable: dict[int, str]) -> str:
    message = "committed" + (f"; {damaged}" if damaged else "")
    if unreadable:
        message += (
            f"; unreadable archived manifests kept for inspection: iterations "
            f"{', '.join(map(str, unreadable))} ({'; '.join(unreadable.values())})"
        )
    return message
