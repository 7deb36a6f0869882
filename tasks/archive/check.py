"""Checking the store's copy, before it is committed and on every later run.

Before the commit: on S3 the store's own full-object CRC64NVME and size of every object
(HeadObject, nothing downloaded) against those of the bytes that hashed as the manifest, and its
encryption; a rotating sample of copies (``archive.readback_fraction``), every copy on a local
directory and every copy on a store that keeps no checksums are also read back and hashed. A bad
object is uploaded once more, then the copy gives up (nothing committed). On a later run, a
committed copy of the promoted save is checked again without reading it (``damage``)."""

import math
from pathlib import Path

from tasks.archive.entries import archived_manifest, entry_key
from tasks.archive.history import copies
from tasks.archive.protect import encryption
from tasks.archive.upload import upload_again
from tasks.checkpoint.manifest import Manifest
from tasks.checkpoint.signing import Trust
from tasks.storage.archive import ArchiveStore, ArchiveUnavailable, Sent, Stored


def reads_back(save_dir: Path, settings) -> bool:
    """Whether the next copy is read back in full: always on a local directory; on S3 a rotating,
    deterministic sample of ``readback_fraction`` of the copies, by the count of copies so far
    (with 1/7: the 1st, 8th, 15th, ...), so that no copy goes unread for long."""
    if not settings.is_s3:
        return True
    n, fraction = len(copies(save_dir)), settings.readback_fraction
    return math.floor(n * fraction + 1e-9) != math.floor((n - 1) * fraction + 1e-9)


def check_stored(
    store: ArchiveStore, job: str, directory: Path, manifest: Manifest, sent: dict[str, Sent], progress
) -> tuple[dict, int]:
    """S3: the store's own checksums and sizes against ``sent`` (once more after one re-upload of
    what differs, which ``sent`` then holds), and the copy's encryption; raises with nothing
    committed if they still differ. Returns what was found, for the archive status, and the bytes
    uploaded again."""
    bad, found = _stored_mismatches(store, sent)
    again: dict[str, Sent] = {}
    if bad:  # one more upload of what the store holds differently, then give up
        again = upload_again(store, job, directory, manifest, bad, progress)
        sent.update(again)
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
        "encryption": encryption(store, found),
    }
    return checked, sum(s.size for s in again.values())


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


def check_read_back(store: ArchiveStore, job: str, directory: Path, manifest: Manifest, progress) -> None:
    """Every object read back and hashed as its manifest does; what differs is uploaded once more,
    then the copy gives up (nothing committed)."""
    bad = _mismatches(store, job, manifest, progress)
    if bad:  # one more upload of what read back wrong, then give up
        upload_again(store, job, directory, manifest, bad, progress)
        bad = _mismatches(store, job, manifest, progress)
        if bad:
            raise ArchiveUnavailable(
                f"{store.where(bad[0])}: reads back different from the manifest after a re-upload; "
                "not committed"
            )


def _mismatches(store: ArchiveStore, job: str, manifest: Manifest, progress) -> list[str]:
    expected = {entry_key(job, manifest.iteration, f.path): (f.size, f.hash) for f in manifest.files}
    found = store.hash_objects(list(expected), manifest.hashing, progress)
    return sorted(key for key, want in expected.items() if found.get(key) != want)


def verified(
    store: ArchiveStore, manifest: Manifest, read_back: bool, fraction: float, checksum: str | None
) -> str:
    """The archive status's ``verified`` line: how the copy was checked before its commit."""
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


def damage(
    store: ArchiveStore, job: str, manifest: Manifest, committed: list[int], trust: Trust
) -> str | None:
    """What is wrong with the committed copy of this very save, if anything: objects vanished or
    shrunk (a lifecycle rule, a hand's rm), by one listing of sizes; else, on S3, a stored checksum
    that differs from the one recorded at the commit, by one HeadObject per object (a copy
    committed before checksums has none). Nothing is read: every run pays it."""
    if manifest.iteration not in committed:
        return None
    archived = archived_manifest(store, job, manifest.iteration, trust)
    if archived.files != manifest.files:
        return None
    found = store.sizes(entry_key(job, manifest.iteration))
    lost = [f.path for f in archived.files if found.get(f.path) != f.size]
    if lost:
        return (
            f"had lost {len(lost)} of its objects ({lost[0]} "
            f"{'missing' if lost[0] not in found else 'cut short'})"
        )
    recorded = (archived.archive or {}).get("crc64nvme") or {}
    if store.is_local or not recorded:
        return None
    keys = {entry_key(job, manifest.iteration, name): name for name in recorded}
    stored = store.heads(list(keys))
    differ = sorted(
        name
        for key, name in keys.items()
        if stored[key] is None or stored[key].crc64nvme not in (recorded[name], None)
    )
    if not differ:
        return None
    return f"had {len(differ)} objects whose stored checksum differs from the one committed ({differ[0]})"
