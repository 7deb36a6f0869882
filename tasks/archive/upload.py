"""Copying a checkpoint's files into its archive entry. What a killed earlier run left there whole
is reused, not sent again. On S3 each file goes up in one read that re-hashes it as its manifest
does and computes the CRC64NVME sent with it (``ArchiveStore.put_checked``: the store checks it on
arrival); on a local directory the files are copied as they are and read back afterwards."""

from pathlib import Path

from tasks.archive.entries import entry_key
from tasks.checkpoint.manifest import Manifest
from tasks.storage.archive import ArchiveStore, Sent, SourceChanged, checksum_file


def upload_files(
    store: ArchiveStore, job: str, directory: Path, manifest: Manifest, progress
) -> tuple[int, int]:
    """A local directory: copy what is not there whole yet; returns (bytes uploaded, bytes reused)."""
    todo, reused = [], 0
    for f in manifest.files:
        key = entry_key(job, manifest.iteration, f.path)
        if store.size(key) == f.size:
            reused += f.size  # a killed run got this far; the read-back still checks it
        else:
            todo.append((directory / f.path, key))
    store.put_files(todo, progress)
    return sum(Path(local).stat().st_size for local, _ in todo), reused


def upload_checked(
    store: ArchiveStore, job: str, directory: Path, manifest: Manifest, progress
) -> tuple[dict[str, Sent], int, int]:
    """S3: upload what is not there whole yet, each file in one read that re-hashes it against
    its manifest and computes its CRC64NVME. Returns (what went up or was reused, by key; bytes
    uploaded; bytes reused)."""
    files = {entry_key(job, manifest.iteration, f.path): f for f in manifest.files}
    sent = _reusable(store, directory, manifest, files)
    todo = [(directory / f.path, key, (f.size, f.hash)) for key, f in files.items() if key not in sent]
    sent.update(store.put_checked_files(todo, manifest.hashing, progress))
    uploaded = sum(files[key].size for key, s in sent.items() if s.uploaded)
    return sent, uploaded, sum(files[key].size for key, s in sent.items() if not s.uploaded)


def _reusable(store: ArchiveStore, directory: Path, manifest: Manifest, files: dict) -> dict[str, Sent]:
    """The objects a killed run left whose size and the store's CRC64NVME are those of the local
    file (read once, not uploaded), by key. A local file that no longer hashes as its manifest
    raises SourceChanged: nothing of it is archived."""
    found = store.heads(list(files))
    candidates = [
        key
        for key, f in files.items()
        if found[key] is not None and found[key].size == f.size and found[key].crc64nvme
    ]
    reused: dict[str, Sent] = {}
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
            reused[key] = local
    return reused


def upload_again(
    store: ArchiveStore, job: str, directory: Path, manifest: Manifest, keys: list[str], progress
) -> dict[str, Sent]:
    """The files of these keys uploaded once more (the store held or read back other bytes), by
    key: on S3 checked against their manifest on the way; on a local directory copied as they
    are (nothing is hashed on the way: the read-back that follows checks them)."""
    files = {entry_key(job, manifest.iteration, f.path): f for f in manifest.files}
    if store.is_local:
        store.put_files([(directory / files[key].path, key) for key in keys], progress)
        return {}
    return store.put_checked_files(
        [(directory / files[key].path, key, (files[key].size, files[key].hash)) for key in keys],
        manifest.hashing,
        progress,
    )
