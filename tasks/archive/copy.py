"""Copy the promoted checkpoint to the archive, committing it the way object stores allow.

Object stores have no rename, so an archive entry is committed by its manifest, written last:

    1. upload the data files (parallel; multipart for large ones), skipping objects a killed
       earlier run already uploaded whole. On S3 one read of each file re-hashes it as its
       manifest does and computes the CRC64NVME sent with it (the store checks it on arrival);
    2. check the store's copy: on S3 the store's own full-object CRC64NVME and size of every
       object (HeadObject, nothing downloaded) against those of the bytes that hashed as the
       manifest, and its encryption; a rotating sample of copies (``archive.readback_fraction``)
       and every copy on a local directory are also read back and hashed. A bad object is
       uploaded once more, then the copy gives up (nothing committed);
    3. on an Object Lock archive, lock the data objects until ``object_lock.days`` after now,
       then write ``<job>/iter_NNNNNNN/manifest.json`` (locked too): the commit marker. A prefix
       without it does not exist for readers, however many objects it holds;
    4. update the archive's pointer object ``<job>/latest_committed_iteration.txt``;
    5. record the copy in the archive's own log beside the job (``.ckptops-history/archive.jsonl``;
       the shared-store manifest is the verifier's alone), then apply archive retention.

Archive layout: ``<archive url>/<job>/iter_NNNNNNN/{files..., manifest.json}``.
"""

import copy
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tasks.checkpoint import layout, signing
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.manifest import (
    UNCHECKED,
    CorruptManifest,
    Manifest,
    check_trusted,
    now_iso,
    parse_manifest,
    sign_manifest,
)
from tasks.checkpoint.pins import pinned, pins
from tasks.checkpoint.pointer import promoted, read_pointer
from tasks.checkpoint.signing import Trust
from tasks.errors import CkptopsError, UsageError
from tasks.storage.archive import (
    AccessDenied,
    ArchiveStore,
    ArchiveUnavailable,
    Sent,
    SourceChanged,
    Stored,
    checksum_file,
)
from tasks.storage.local import append_jsonl, list_files, own_folder, read_jsonl

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
    kept: list[str] = field(default_factory=list)  # why archive retention kept a copy it could drop
    read_back: bool = True  # the copy was read back in full (else checked by the store's checksums)

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


def archived_manifest(store: ArchiveStore, job: str, iteration: int, trust: Trust = UNCHECKED) -> Manifest:
    """A committed entry's manifest, its signature checked as ``trust`` (the job's ``sign``
    section) asks: one that does not verify is unreadable, never used."""
    key = entry_key(job, iteration, layout.MANIFEST)
    try:
        raw = store.read(key)
        manifest = parse_manifest(raw, store.where(key))
    except FileNotFoundError:
        raise NoEntry(f"{store.where(key)}: no committed archive entry") from None
    except AccessDenied as e:
        raise UnreadableManifest(f"{e} (unreadable archived manifest)") from None
    except CorruptManifest as e:
        raise UnreadableManifest(f"{e} (unreadable archived manifest)") from None
    if trust.checks:
        signature_key = entry_key(job, iteration, layout.SIGNATURE)
        try:
            signature = store.read(signature_key)
        except FileNotFoundError:
            signature = None
        except AccessDenied as e:
            raise UnreadableManifest(f"{e} (unreadable signature)") from None
        name = signing.name_of(job, iteration)  # from where it is kept, not from what it says
        try:
            check_trusted(
                manifest, raw, signature, (store.where(key), store.where(signature_key)), trust, name
            )
        except signing.BadSignature as e:
            raise UnreadableManifest(f"{e} (untrusted archived manifest)") from None
    return manifest


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


def _upload_checked(
    store: ArchiveStore, job: str, directory: Path, manifest: Manifest, progress
) -> tuple[dict[str, Sent], int, int]:
    """S3: upload what is not there whole yet, each file in one read that re-hashes it against
    its manifest and computes its CRC64NVME. An object a killed run left is reused when the store's
    CRC64NVME is that of the local file (read once, not uploaded). Returns (what went up or was
    reused, by key; bytes uploaded; bytes reused)."""
    files = {entry_key(job, manifest.iteration, f.path): f for f in manifest.files}
    found = store.heads(list(files))
    candidates = [
        key
        for key, f in files.items()
        if found[key] is not None and found[key].size == f.size and found[key].crc64nvme
    ]
    sent: dict[str, Sent] = {}
    for key, local in store.parallel(
        lambda key: (key, checksum_file(directory / files[key].path, manifest.hashing)),
        candidates,
    ):
        f = files[key]
        if (local.size, local.hash) != (f.size, f.hash):
            raise SourceChanged(
                f"{directory / f.path}: hash {local.hash}, its manifest says {f.hash}: the source "
                "changed since it was verified; not archived"
            )
        if local.crc64nvme == found[key].crc64nvme:
            sent[key] = local
    todo = [(directory / f.path, key, (f.size, f.hash)) for key, f in files.items() if key not in sent]
    sent.update(store.put_checked_files(todo, manifest.hashing, progress))
    uploaded = sum(files[key].size for key, s in sent.items() if s.uploaded)
    return sent, uploaded, sum(files[key].size for key, s in sent.items() if not s.uploaded)


def _stored_mismatches(
    store: ArchiveStore, sent: dict[str, Sent]
) -> tuple[list[str], dict[str, Stored | None]]:
    """Keys whose stored size or full-object CRC64NVME (the store's own, read by HeadObject) is not
    that of the bytes that hashed as the manifest; and what the store said. A store that keeps no
    checksum (an older MinIO or Ceph) answers none: that object is not bad, but unchecked
    (``_unchecked``), and the copy is read back instead."""
    found = store.heads(list(sent))
    bad = [
        key
        for key, s in sent.items()
        if found[key] is None or found[key].size != s.size or found[key].crc64nvme not in (s.crc64nvme, None)
    ]
    return sorted(bad), found


def _unchecked(found: dict[str, Stored | None]) -> list[str]:
    return sorted(key for key, stored in found.items() if stored is not None and stored.crc64nvme is None)


def _encryption(store: ArchiveStore, found: dict[str, Stored | None]) -> dict:
    """How the store says it encrypted the copy; a copy not encrypted as asked is not committed."""
    settings = store.settings
    for key, stored in sorted(found.items()):
        if settings.sse != "none" and stored.sse != settings.sse:
            raise ArchiveUnavailable(
                f"{store.where(key)}: stored with encryption {stored.sse or 'none'}, the archive asks "
                f"for {settings.sse}; not committed"
            )
        wanted = settings.kms_key_id
        if (
            settings.sse == "aws:kms"
            and wanted
            and not wanted.startswith("alias/")
            and stored.kms_key_id
            and not (stored.kms_key_id.endswith(wanted) or wanted.endswith(stored.kms_key_id))
        ):
            raise ArchiveUnavailable(
                f"{store.where(key)}: encrypted with KMS key {stored.kms_key_id}, the archive asks "
                f"for {wanted}; not committed"
            )
    first = found[min(found)] if found else None
    return {
        "sse": (first.sse if first else None) or "none reported",
        "kms_key_id": first.kms_key_id if first else None,
        "bucket_key": bool(first and first.bucket_key),
    }


def _mismatches(store: ArchiveStore, job: str, manifest: Manifest, progress) -> list[str]:
    expected = {entry_key(job, manifest.iteration, f.path): (f.size, f.hash) for f in manifest.files}
    found = store.hash_objects(list(expected), manifest.hashing, progress)
    return sorted(key for key, want in expected.items() if found.get(key) != want)


def _refuse_an_entry_nobody_could_read(manifest: Manifest, trust: Trust) -> None:
    """Under ``sign.required`` an archived manifest this host cannot sign (no key here, or XXH3
    digests) would be unreadable once committed: refused before anything is uploaded."""
    if not trust.required or trust.signs_manifest(manifest):
        return
    why = (
        "no sign.key_file or key_secret here"
        if not trust.signs
        else f"its digests are {manifest.hash_algorithm}"
    )
    raise UsageError(
        f"{layout.iter_dir_name(manifest.iteration)}: not archived: sign.required is set but its archived "
        f"manifest could not be signed ({why}); nothing uploaded"
    )


def _commit(
    store: ArchiveStore, job: str, manifest: Manifest, source: Path, checked: dict, lock_until, trust: Trust
) -> dict:
    status = {
        "url": store.where(entry_key(job, manifest.iteration)),
        "committed_at": now_iso(),
        **checked,
        "source": str(source),
        "host": socket.gethostname(),
    }
    archived = copy.deepcopy(manifest)
    archived.archive = status
    data = archived.to_json().encode()
    key = entry_key(job, manifest.iteration, layout.MANIFEST)
    name = signing.name_of(job, manifest.iteration)
    signature, _ = sign_manifest(archived, data, trust, store.where(key), name)
    if signature is not None:  # before the commit marker
        store.write(entry_key(job, manifest.iteration, layout.SIGNATURE), signature, lock_until=lock_until)
    store.write(key, data, lock_until=lock_until)
    store.write(f"{job}/{POINTER_OBJECT}", f"{manifest.iteration}\n".encode())
    return status


def _by_commit_time(
    store: ArchiveStore, job: str, committed: list[int], trust: Trust
) -> tuple[dict[int, dict], dict[int, str]]:
    """The archive status of the committed iterations (``committed_at``, ``object_lock``, ...),
    oldest commit first (after a rollback an older iteration is newer), and the iterations whose
    manifest cannot be read or trusted, each with why (the entry's file and, for a signature,
    the key): one bad entry must not stop the archive, and it is left out of retention for a
    human to look at."""
    times, unreadable = {}, {}
    for iteration in committed:
        try:
            status = archived_manifest(store, job, iteration, trust).archive or {}
        except UnreadableManifest as e:  # an outage (ArchiveUnavailable) still fails the run
            unreadable[iteration] = str(e)
            continue
        except NoEntry:  # uncommitted since it was listed
            continue
        times[iteration] = {"committed_at": "1970-01-01T00:00:00+00:00", **status}
    return dict(sorted(times.items(), key=lambda item: item[1]["committed_at"])), unreadable


def _locked_until(store: ArchiveStore, job: str, iteration: int, status: dict) -> tuple[str, datetime] | None:
    """The Object Lock mode and date an entry is locked until, if that is still ahead: the later
    of the recorded one and the one the store reports for its manifest (a lock may be extended)."""
    recorded = status.get("object_lock") or {}
    dates = [(recorded.get("mode"), recorded.get("retain_until"))]
    if not store.is_local:
        stored = store.head(entry_key(job, iteration, layout.MANIFEST))
        if stored is not None and stored.retain_until:
            dates.append((stored.lock_mode, stored.retain_until))
    ahead = [
        (mode, datetime.fromisoformat(until))
        for mode, until in dates
        if until and datetime.fromisoformat(until) > datetime.now(UTC)
    ]
    return max(ahead, key=lambda item: item[1]) if ahead else None


def apply_archive_retention(
    store: ArchiveStore,
    job: str,
    keep: int,
    keep_days: float | None = None,
    pinned_iterations=(),
    notes: list[str] | None = None,
    trust: Trust = UNCHECKED,
) -> list[int]:
    """Keep the ``keep`` most recently committed entries (commit time, not iteration: after a
    rollback an older iteration is the newest copy), every entry committed within ``keep_days``,
    the one the pointer object names and those pinned in the save directory; never the only one,
    never before a newer one committed. An entry under Object Lock is never deleted before its
    retain-until date: it is kept and ``notes`` says until when. An entry is uncommitted
    (manifest removed) before its objects go, so a reader never sees half of one; on an Object
    Lock archive every version of its objects goes (a plain delete would only hide them).
    Uncommitted leftovers older than the newest commit are removed too."""
    committed = committed_iterations(store, job)
    statuses = _by_commit_time(store, job, committed, trust)[0]
    by_commit = list(statuses)
    named = newest_committed(store, job)
    deleted, notes = [], notes if notes is not None else []
    young = datetime.now(UTC) - timedelta(days=keep_days or 0)
    for iteration in by_commit[:-keep] if len(by_commit) > keep else []:
        if iteration == named or iteration in pinned_iterations:
            continue
        if keep_days is not None and datetime.fromisoformat(statuses[iteration]["committed_at"]) > young:
            continue
        locked = _locked_until(store, job, iteration, statuses[iteration])
        if locked is not None:
            notes.append(
                f"archive copy of iteration {iteration} kept: Object Lock ({locked[0]}) until "
                f"{locked[1].isoformat(timespec='seconds')}; archive retention can delete it from then"
            )
            continue
        store.remove(entry_key(job, iteration, layout.MANIFEST))
        if statuses[iteration].get("object_lock") and not store.is_local:
            store.remove_versions(entry_key(job, iteration))
        else:
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
    return read_jsonl(copies_path(save_dir))


def status_lines(save_dir: Path) -> list[str]:
    """What ``ckptops status`` says about the archive: the newest copy in the archive's log, how it
    was checked, its encryption and Object Lock as the store reported them at the commit."""
    logged = copies(save_dir)
    if not logged:
        return []
    last = logged[-1]
    lines = [
        f"archive: {len(logged)} {'copy' if len(logged) == 1 else 'copies'} logged; "
        f"newest: iteration {last.get('iteration')} at "
        f"{last.get('url')}, committed {last.get('committed_at')}"
    ]
    check = "CRC64NVME by the store" if last.get("crc64nvme") else "read back"
    if last.get("crc64nvme"):
        check += ", read back too" if last.get("read_back") else ", not read back (not in the sample)"
    lines.append(f"archive check: {check}")
    encryption = last.get("encryption")
    if encryption:
        key = f" key {encryption['kms_key_id']}" if encryption.get("kms_key_id") else ""
        bucket_key = ", bucket key" if encryption.get("bucket_key") else ""
        lines.append(f"archive encryption: {encryption.get('sse')}{key}{bucket_key}")
    lock = last.get("object_lock")
    if lock:
        lines.append(f"archive object lock: {lock['mode']} until {lock['retain_until']}")
    return lines


def reads_back(save_dir: Path, settings) -> bool:
    """Whether the next copy is read back in full: always on a local directory; on S3 a rotating,
    deterministic sample of ``readback_fraction`` of the copies, by the count of copies so far
    (with 1/7: the 1st, 8th, 15th, ...), so that no copy goes unread for long."""
    if not settings.is_s3:
        return True
    n, fraction = len(copies(save_dir)), settings.readback_fraction
    return math.floor(n * fraction + 1e-9) != math.floor((n - 1) * fraction + 1e-9)


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
    """Copy the promoted checkpoint to the archive (once per period unless ``force``)."""
    if profile.archive is None:
        raise UsageError(f"{profile.source}: no archive section")
    save_dir = Path(save_dir)
    job, trust = profile.job.name, Trust.of(profile)
    store = ArchiveStore.from_settings(profile.archive)
    with job_lock(save_dir, profile.verify.lock_timeout_seconds, name=layout.ARCHIVE_LOCK):
        found = promoted(save_dir, trust)
        iteration, directory, manifest = found.iteration, found.directory, found.manifest
        _refuse_an_entry_nobody_could_read(manifest, trust)
        committed = committed_iterations(store, job)
        commit_times, unreadable = _by_commit_time(store, job, committed, trust)
        if iteration in unreadable:
            return ArchiveResult(
                iteration,
                store.where(entry_key(job, iteration)),
                False,
                f"iteration {iteration} is archived but its archived manifest is unreadable "
                f"({unreadable[iteration]}); kept for inspection, never overwritten",
            )
        damaged = _uncommit_if_damaged(store, job, manifest, committed, trust)
        skip = (
            None
            if damaged
            else _skip_reason(
                store, job, manifest, committed, commit_times, profile.archive.period_hours, force, trust
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
        if profile.archive.object_lock is not None:
            store.check_object_lock()
        read_back = reads_back(save_dir, profile.archive)
        with pinned(save_dir, iteration, f"archive-{os.getpid()}", "archive copy reading"):
            if store.is_local:
                uploaded, reused = _upload(store, job, directory, manifest, progress)
                checked = {"read_back": True}
            else:
                uploaded, reused, checked = _upload_and_check(store, job, directory, manifest, progress)
                # A store that keeps no checksums proves nothing by them: read this copy back.
                read_back = read_back or checked["checksum"] != "CRC64NVME"
            if read_back:
                _read_back(store, job, directory, manifest, progress)
            checked["verified"] = _verified(
                store, manifest, read_back, profile.archive.readback_fraction, checked.get("checksum")
            )
            checked["read_back"] = read_back
            lock_until = None
            if profile.archive.object_lock is not None:
                lock_until = datetime.now(UTC).replace(microsecond=0) + timedelta(
                    days=profile.archive.object_lock.days
                )
                store.lock([entry_key(job, iteration, f.path) for f in manifest.files], lock_until)
                checked["object_lock"] = {
                    "mode": profile.archive.object_lock.mode,
                    "retain_until": lock_until.isoformat(),
                }
            status = _commit(store, job, manifest, directory, checked, lock_until, trust)
        seconds = time.monotonic() - started
        append_jsonl(own_folder(save_dir, layout.HISTORY) / COPIES, {"iteration": iteration, **status})
        kept: list[str] = []
        deleted = apply_archive_retention(
            store,
            job,
            profile.archive.keep,
            profile.archive.keep_days,
            set(pins(save_dir)),
            kept,
            trust,
        )
        message = (
            "committed"
            + (f"; {damaged}" if damaged else "")
            + (
                f"; unreadable archived manifests kept for inspection: iterations "
                f"{', '.join(map(str, unreadable))} ({'; '.join(unreadable.values())})"
                if unreadable
                else ""
            )
        )
        return ArchiveResult(
            iteration, status["url"], True, message, uploaded, reused, seconds, deleted, kept, read_back
        )


def _upload_and_check(
    store: ArchiveStore, job: str, directory: Path, manifest: Manifest, progress
) -> tuple[int, int, dict]:
    """S3: upload with checksums, then check the store's own checksums (once more after one
    re-upload of what differs); raises with nothing committed if they still differ."""
    sent, uploaded, reused = _upload_checked(store, job, directory, manifest, progress)
    bad, found = _stored_mismatches(store, sent)
    if bad:  # one more upload of what the store holds differently, then give up
        by_key = {entry_key(job, manifest.iteration, f.path): f for f in manifest.files}
        again = store.put_checked_files(
            [(directory / by_key[k].path, k, (by_key[k].size, by_key[k].hash)) for k in bad],
            manifest.hashing,
            progress,
        )
        sent.update(again)
        uploaded += sum(s.size for s in again.values())
        bad, found = _stored_mismatches(store, sent)
        if bad:
            stored = found[bad[0]]
            raise ArchiveUnavailable(
                f"{store.where(bad[0])}: the store holds "
                + (
                    "no object"
                    if stored is None
                    else f"{stored.size} bytes, CRC64NVME {stored.crc64nvme or 'none'}"
                )
                + f" after a re-upload of {sent[bad[0]].size} bytes, CRC64NVME {sent[bad[0]].crc64nvme}; "
                "not committed"
            )
    checked = {
        "checksum": "none kept by the store" if _unchecked(found) else "CRC64NVME",
        "crc64nvme": {key.rsplit("/", 1)[-1]: s.crc64nvme for key, s in sorted(sent.items())},
        "encryption": _encryption(store, found),
    }
    return uploaded, reused, checked


def _read_back(store: ArchiveStore, job: str, directory: Path, manifest: Manifest, progress) -> None:
    bad = _mismatches(store, job, manifest, progress)
    if bad:  # one more upload of what read back wrong, then give up
        names = {key.rsplit("/", 1)[-1] for key in bad}
        pairs = [(directory / n, entry_key(job, manifest.iteration, n)) for n in sorted(names)]
        if store.is_local:
            store.put_files(pairs, progress)
        else:
            files = {f.path: f for f in manifest.files}
            store.put_checked_files(
                [(local, key, (files[local.name].size, files[local.name].hash)) for local, key in pairs],
                manifest.hashing,
                progress,
            )
        bad = _mismatches(store, job, manifest, progress)
        if bad:
            raise ArchiveUnavailable(
                f"{store.where(bad[0])}: reads back different from the manifest after a re-upload; "
                "not committed"
            )


def _verified(
    store: ArchiveStore, manifest: Manifest, read_back: bool, fraction: float, checksum: str | None
) -> str:
    read = f"every object read back: size and {manifest.hash_algorithm} match"
    if store.is_local:
        return read
    checked = (
        f"the store's CRC64NVME and size of every object match those of the bytes that hashed as the "
        f"manifest ({manifest.hash_algorithm})"
        if checksum == "CRC64NVME"
        else "the store keeps no checksums: sizes only"
    )
    return f"{checked}; {read}" if read_back else f"{checked}; not read back (sampled copies: {fraction:.3g})"


def _uncommit_if_damaged(
    store: ArchiveStore, job: str, manifest: Manifest, committed: list[int], trust: Trust
) -> str | None:
    """A committed copy of this very save whose objects have vanished or shrunk (a lifecycle rule,
    a hand's rm) is no copy: it is uncommitted (its manifest removed) and copied again. Checked by
    one listing of sizes, not by reading: every run pays it."""
    if manifest.iteration not in committed:
        return None
    archived = archived_manifest(store, job, manifest.iteration, trust)
    if archived.files != manifest.files:
        return None
    found = store.sizes(entry_key(job, manifest.iteration))
    damaged = [f.path for f in archived.files if found.get(f.path) != f.size]
    if damaged:
        what = (
            f"had lost {len(damaged)} of its objects ({damaged[0]} "
            f"{'missing' if damaged[0] not in found else 'cut short'})"
        )
    else:
        # The store's own checksum of each object against the one recorded at the commit: one
        # HeadObject per object, nothing read (a copy committed before checksums has none).
        recorded = (archived.archive or {}).get("crc64nvme") or {}
        if store.is_local or not recorded:
            return None
        keys = {entry_key(job, manifest.iteration, name): name for name in recorded}
        stored = store.heads(list(keys))
        damaged = sorted(
            name
            for key, name in keys.items()
            if stored[key] is None or stored[key].crc64nvme not in (recorded[name], None)
        )
        if not damaged:
            return None
        what = (
            f"had {len(damaged)} objects whose stored checksum differs from the one committed ({damaged[0]})"
        )
    store.remove(entry_key(job, manifest.iteration, layout.MANIFEST))
    committed.remove(manifest.iteration)
    return f"the committed copy {what}: uncommitted and copied again"


def _skip_reason(
    store: ArchiveStore,
    job: str,
    manifest: Manifest,
    committed: list[int],
    commit_times: dict[int, dict],
    period_hours: float,
    force: bool,
    trust: Trust,
) -> str | None:
    if manifest.iteration in committed:
        archived = archived_manifest(store, job, manifest.iteration, trust)
        if archived.files == manifest.files:
            return f"iteration {manifest.iteration} is already archived"
    if force or not commit_times:
        return None
    newest = list(commit_times)[-1]
    committed_at = datetime.fromisoformat(commit_times[newest]["committed_at"])
    age_hours = (datetime.now(UTC) - committed_at).total_seconds() / 3600
    if age_hours < period_hours:
        return (
            f"the newest archive copy (iteration {newest}) is {age_hours:.1f} h old, "
            f"the period is {period_hours:g} h"
        )
    return None
