"""Committing a checked copy, and undoing a commit.

Object stores have no rename, so an entry is committed by its manifest, written last: the archived
manifest (the promoted one with the archive status in it, signed as the job's ``sign`` section
asks, its signature written first) is the commit marker, and a prefix without it does not exist
for readers, however many objects it holds; then the pointer object names the entry. Undoing a
commit removes the manifest first, so a reader never sees half an entry: a damaged committed copy
is uncommitted so it is copied again, ``archive --force`` uncommits an entry whose archived
manifest cannot be read or trusted so the promoted save is copied into it afresh, and archive
retention uncommits an entry before its objects go."""

import copy
import socket
from datetime import datetime
from pathlib import Path

from tasks.archive.check import damage
from tasks.archive.entries import POINTER_OBJECT, entry_key
from tasks.checkpoint import layout, signing
from tasks.checkpoint.manifest import Manifest, now_iso, sign_manifest
from tasks.checkpoint.signing import Trust
from tasks.errors import UsageError
from tasks.storage.archive import ArchiveStore


def refuse_an_entry_nobody_could_read(manifest: Manifest, trust: Trust) -> None:
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


def commit(
    store: ArchiveStore,
    job: str,
    manifest: Manifest,
    source: Path,
    checked: dict,
    lock_until: datetime | None,
    trust: Trust,
) -> dict:
    """Write the archived manifest (and its signature, before it), locked until ``lock_until`` on
    an Object Lock archive, then the pointer object; returns the archive status it holds."""
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


def uncommit(store: ArchiveStore, job: str, iteration: int) -> None:
    """Remove an entry's commit marker: from now on its objects are no entry for readers."""
    store.remove(entry_key(job, iteration, layout.MANIFEST))


def uncommit_if_damaged(
    store: ArchiveStore, job: str, manifest: Manifest, committed: list[int], trust: Trust
) -> str | None:
    """A committed copy of this very save that is damaged (``check.damage``) is no copy: it is
    uncommitted, taken out of ``committed``, and copied again. Returns what the run says of it."""
    what = damage(store, job, manifest, committed, trust)
    if what is None:
        return None
    uncommit(store, job, manifest.iteration)
    committed.remove(manifest.iteration)
    return f"the committed copy {what}: uncommitted and copied again"


def uncommit_unreadable(
    store: ArchiveStore, job: str, iteration: int, committed: list[int], unreadable: dict[int, str]
) -> str:
    """``archive --force`` on the promoted iteration whose committed entry's manifest cannot be
    read or trusted (``entries.by_commit_time`` found it): its manifest, then its signature, are
    removed, so the entry is no entry for readers and the promoted save is copied into it as into
    a new one (objects found whole are reused, and checked as every copy's are). It is taken out
    of ``committed`` and ``unreadable``. On an Object Lock bucket the old versions stay, locked.
    Returns what the run says of it."""
    why = unreadable.pop(iteration)
    uncommit(store, job, iteration)
    store.remove(entry_key(job, iteration, layout.SIGNATURE))
    committed.remove(iteration)
    return f"its archived manifest was unreadable ({why}): replaced (--force)"
