"""Copy the promoted checkpoint to the archive, committing it the way object stores allow.

Object stores have no rename, so an archive entry is committed by its manifest, written last:

    1. upload the data files (parallel; multipart for large ones), skipping objects a killed
       earlier run already uploaded whole;
    2. read every object back and compare size and XXH3-128 with the manifest; re-upload a bad
       one once, and give up (nothing committed) if it is still bad;
    3. write ``<job>/iter_NNNNNNN/manifest.json``: the commit marker. A prefix without it does
       not exist for readers, however many objects it holds;
    4. update the archive's pointer object ``<job>/latest_committed_iteration.txt``;
    5. record the copy in the archive's own log beside the job (``.ckptops-history/archive.jsonl``;
       the shared-store manifest is the verifier's alone), then apply archive retention.

Archive layout: ``<archive url>/<job>/iter_NNNNNNN/{files..., manifest.json}``.
"""

import copy
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.manifest import CorruptManifest, Manifest, now_iso
from tasks.checkpoint.pins import pinned
from tasks.checkpoint.pointer import promoted, read_pointer
from tasks.errors import CkptopsError, UsageError
from tasks.storage.archive import AccessDenied, ArchiveStore, ArchiveUnavailable
from tasks.storage.local import append_jsonl, list_files, read_jsonl

POINTER_OBJECT = "latest_committed_iteration.txt"
COPIES = "archive.jsonl"


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

    @property
    def throughput_gbps(self) -> float:
        return self.uploaded_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def entry_key(job: str, iteration: int, name: str = "") -> str:
    return "/".join(p for p in (job, layout.iter_dir_name(iteration), name) if p)


def committed_iterations(store: ArchiveStore, job: str) -> list[int]:
    """Iterations with a committed archive entry (their manifest is there), oldest first."""
    found = []
    for name in store.listdir(job):
        iteration = layout.parse_iter_dir(name)
        if iteration is not None and store.exists(entry_key(job, iteration, layout.MANIFEST)):
            found.append(iteration)
    return sorted(found)


class UnreadableManifest(CkptopsError):
    """An archived manifest that exists but does not parse or may not be read (not an outage)."""


class NoEntry(CkptopsError):
    """No committed manifest at that key (never committed, or removed meanwhile)."""


def archived_manifest(store: ArchiveStore, job: str, iteration: int) -> Manifest:
    key = entry_key(job, iteration, layout.MANIFEST)
    try:
        data = json.loads(store.read(key))
    except FileNotFoundError:
        raise NoEntry(f"{store.where(key)}: no committed archive entry") from None
    except AccessDenied as e:
        raise UnreadableManifest(f"{e} (unreadable archived manifest)") from None
    except ValueError as e:
        raise UnreadableManifest(f"{store.where(key)}: unreadable archived manifest ({e})") from None
    try:
        return Manifest.from_dict(data, store.where(key))
    except CorruptManifest as e:
        raise UnreadableManifest(f"{e} (unreadable archived manifest)") from None


def newest_committed(store: ArchiveStore, job: str) -> int | None:
    """The archive pointer object if it names a committed entry, else the newest committed."""
    committed = committed_iterations(store, job)
    try:
        named = int(store.read(f"{job}/{POINTER_OBJECT}").decode().strip())
    except (FileNotFoundError, ValueError):
        named = None
    if named in committed:
        return named
    return committed[-1] if committed else None


def _files_to_copy(manifest: Manifest) -> dict[str, int]:
    return {f.path: f.size for f in manifest.files}


def _upload(store: ArchiveStore, job: str, directory: Path, manifest: Manifest, progress) -> tuple[int, int]:
    """Upload what is not there whole yet; returns (bytes uploaded, bytes reused)."""
    todo, reused = [], 0
    for name, size in _files_to_copy(manifest).items():
        key = entry_key(job, manifest.iteration, name)
        if store.size(key) == size:
            reused += size  # a killed run got this far; the read-back below still checks it
        else:
            todo.append((directory / name, key))
    store.put_files(todo, progress)
    return sum(Path(local).stat().st_size for local, _ in todo), reused


def _mismatches(store: ArchiveStore, job: str, manifest: Manifest, progress) -> list[str]:
    expected = {entry_key(job, manifest.iteration, f.path): (f.size, f.hash) for f in manifest.files}
    found = store.hash_objects(list(expected), manifest.hashing, progress)
    return sorted(key for key, want in expected.items() if found.get(key) != want)


def _commit(store: ArchiveStore, job: str, manifest: Manifest, source: Path) -> dict:
    status = {
        "url": store.where(entry_key(job, manifest.iteration)),
        "committed_at": now_iso(),
        "verified": f"every object read back: size and {manifest.hash_algorithm} match",
        "source": str(source),
        "host": socket.gethostname(),
    }
    archived = copy.deepcopy(manifest)
    archived.archive = status
    store.write(entry_key(job, manifest.iteration, layout.MANIFEST), archived.to_json().encode())
    store.write(f"{job}/{POINTER_OBJECT}", f"{manifest.iteration}\n".encode())
    return status


def _by_commit_time(store: ArchiveStore, job: str, committed: list[int]) -> tuple[dict[int, str], list[int]]:
    """Commit times of the committed iterations, oldest commit first (after a rollback an older
    iteration is newer), and the iterations whose manifest cannot be read: one bad entry must not
    stop the archive, and it is
    left out of retention for a human to look at."""
    times, unreadable = {}, []
    for iteration in committed:
        try:
            status = archived_manifest(store, job, iteration).archive or {}
        except UnreadableManifest:  # an outage (ArchiveUnavailable) still fails the run
            unreadable.append(iteration)
            continue
        except NoEntry:  # uncommitted since it was listed
            continue
        times[iteration] = status.get("committed_at", "1970-01-01T00:00:00+00:00")
    return dict(sorted(times.items(), key=lambda item: item[1])), unreadable


def apply_archive_retention(store: ArchiveStore, job: str, keep: int) -> list[int]:
    """Keep the ``keep`` most recently committed entries (commit time, not iteration: after a
    rollback an older iteration is the newest copy) and the one the pointer object names; never
    the only one, never before a newer one committed. An entry is uncommitted (manifest removed)
    before its objects go, so a reader never sees half of one. Uncommitted leftovers older than
    the newest commit are removed too."""
    committed = committed_iterations(store, job)
    by_commit = list(_by_commit_time(store, job, committed)[0])
    named = newest_committed(store, job)
    deleted = []
    for iteration in by_commit[:-keep] if len(by_commit) > keep else []:
        if iteration == named:
            continue
        store.remove(entry_key(job, iteration, layout.MANIFEST))
        store.remove(entry_key(job, iteration), recursive=True)
        deleted.append(iteration)
    newest = max(committed) if committed else None
    for name in store.listdir(job):
        iteration = layout.parse_iter_dir(name)
        if iteration is not None and newest is not None and iteration < newest and iteration not in committed:
            store.remove(entry_key(job, iteration), recursive=True)
    return deleted


def copies_path(save_dir: Path) -> Path:
    return Path(save_dir) / layout.HISTORY / COPIES


def copies(save_dir: Path) -> list[dict]:
    """Every committed copy of the job's checkpoints, oldest first: iteration, where, when, how
    it was checked, from where (the archive's own log; the archive itself is the authority)."""
    return [entry for entry in read_jsonl(copies_path(save_dir)) if isinstance(entry, dict)]


def progress_total(save_dir: Path) -> int:
    """What a copy's progress counts up to: the promoted checkpoint's bytes twice (each file is
    uploaded, then read back); 0 when nothing is promoted."""
    iteration = read_pointer(save_dir)
    if iteration is None:
        return 0
    return 2 * sum(st.st_size for st in list_files(Path(save_dir) / layout.iter_dir_name(iteration)).values())


def archive_checkpoint(
    save_dir: Path, profile, force: bool = False, progress: Callable[[int], None] | None = None
) -> ArchiveResult:
    """Copy the promoted checkpoint to the archive (once per period unless ``force``)."""
    if profile.archive is None:
        raise UsageError(f"{profile.source}: no archive section")
    save_dir = Path(save_dir)
    job = profile.job.name
    store = ArchiveStore.from_settings(profile.archive)
    with job_lock(save_dir, profile.verify.lock_timeout_seconds, name=layout.ARCHIVE_LOCK):
        found = promoted(save_dir)
        iteration, directory, manifest = found.iteration, found.directory, found.manifest
        committed = committed_iterations(store, job)
        commit_times, unreadable = _by_commit_time(store, job, committed)
        if iteration in unreadable:
            return ArchiveResult(
                iteration,
                store.where(entry_key(job, iteration)),
                False,
                f"iteration {iteration} is archived but its archived manifest is unreadable; "
                "kept for inspection, never overwritten",
            )
        damaged = _uncommit_if_damaged(store, job, manifest, committed)
        skip = (
            None
            if damaged
            else _skip_reason(
                store, job, manifest, committed, commit_times, profile.archive.period_hours, force
            )
        )
        if skip:
            return ArchiveResult(iteration, store.where(entry_key(job, iteration)), False, skip)
        if iteration in committed:
            # The same iteration with other bytes (Megatron re-saved it after a rollback). Its
            # committed copy may be the only one: never overwrite it; the next promotion archives.
            return ArchiveResult(
                iteration,
                store.where(entry_key(job, iteration)),
                False,
                f"iteration {iteration} is already archived from an earlier save; its committed "
                "copy is kept, the next promoted iteration will be archived",
            )
        started = time.monotonic()
        with pinned(save_dir, iteration, f"archive-{os.getpid()}", "archive copy reading"):
            uploaded, reused = _upload(store, job, directory, manifest, progress)
            bad = _mismatches(store, job, manifest, progress)
            if bad:  # one more upload of what read back wrong, then give up
                names = {key.rsplit("/", 1)[-1] for key in bad}
                store.put_files(
                    [(directory / n, entry_key(job, iteration, n)) for n in sorted(names)], progress
                )
                bad = _mismatches(store, job, manifest, progress)
                if bad:
                    raise ArchiveUnavailable(
                        f"{store.where(bad[0])}: reads back different from the manifest after a re-upload; "
                        "not committed"
                    )
            status = _commit(store, job, manifest, directory)
        seconds = time.monotonic() - started
        append_jsonl(copies_path(save_dir), {"iteration": iteration, **status})
        deleted = apply_archive_retention(store, job, profile.archive.keep)
        message = (
            "committed"
            + (f"; {damaged}" if damaged else "")
            + (
                f"; unreadable archived manifests kept for inspection: iterations "
                f"{', '.join(map(str, unreadable))}"
                if unreadable
                else ""
            )
        )
        return ArchiveResult(iteration, status["url"], True, message, uploaded, reused, seconds, deleted)


def _uncommit_if_damaged(
    store: ArchiveStore, job: str, manifest: Manifest, committed: list[int]
) -> str | None:
    """A committed copy of this very save whose objects have vanished or shrunk (a lifecycle rule,
    a hand's rm) is no copy: it is uncommitted (its manifest removed) and copied again. Checked by
    one listing of sizes, not by reading: every run pays it."""
    if manifest.iteration not in committed:
        return None
    archived = archived_manifest(store, job, manifest.iteration)
    if archived.files != manifest.files:
        return None
    found = store.sizes(entry_key(job, manifest.iteration))
    damaged = [f.path for f in archived.files if found.get(f.path) != f.size]
    if not damaged:
        return None
    store.remove(entry_key(job, manifest.iteration, layout.MANIFEST))
    committed.remove(manifest.iteration)
    return (
        f"the committed copy had lost {len(damaged)} of its objects ({damaged[0]} "
        f"{'missing' if damaged[0] not in found else 'cut short'}): uncommitted and copied again"
    )


def _skip_reason(
    store: ArchiveStore,
    job: str,
    manifest: Manifest,
    committed: list[int],
    commit_times: dict[int, str],
    period_hours: float,
    force: bool,
) -> str | None:
    if manifest.iteration in committed:
        archived = archived_manifest(store, job, manifest.iteration)
        if archived.files == manifest.files:
            return f"iteration {manifest.iteration} is already archived"
    if force or not commit_times:
        return None
    newest = list(commit_times)[-1]
    committed_at = datetime.fromisoformat(commit_times[newest])
    age_hours = (datetime.now(UTC) - committed_at).total_seconds() / 3600
    if age_hours < period_hours:
        return (
            f"the newest archive copy (iteration {newest}) is {age_hours:.1f} h old, "
            f"the period is {period_hours:g} h"
        )
    return None
