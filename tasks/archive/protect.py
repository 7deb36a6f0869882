"""The archive's protection of a copy: the encryption the store reports for its objects checked
against the archive's ``sse`` and ``kms_key_id`` (a copy encrypted otherwise is not committed), and
Object Lock: the data objects locked until ``object_lock.days`` after the commit, and the date an
entry is still locked until (which archive retention respects). The bucket's own Object Lock
configuration is checked by the store (``ArchiveStore.check_object_lock``) before anything goes up."""

from datetime import UTC, datetime, timedelta

from tasks.archive.entries import entry_key
from tasks.checkpoint import layout
from tasks.checkpoint.manifest import Manifest
from tasks.storage.archive import ArchiveStore, ArchiveUnavailable, Stored


def encryption(store: ArchiveStore, found: dict[str, Stored | None]) -> dict:
    """How the store says it encrypted the copy; a copy not encrypted as asked is not committed."""
    for key, stored in sorted(found.items()):
        _check_encryption(store, key, stored)
    first = found[min(found)] if found else None
    return {
        "sse": (first.sse if first else None) or "none reported",
        "kms_key_id": first.kms_key_id if first else None,
        "bucket_key": bool(first and first.bucket_key),
    }


def _check_encryption(store: ArchiveStore, key: str, stored: Stored) -> None:
    settings = store.settings
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


def lock_objects(store: ArchiveStore, job: str, manifest: Manifest, object_lock) -> tuple[datetime, dict]:
    """Lock the copy's data objects until ``object_lock.days`` from now (the manifest written at
    the commit gets the same date); returns that date and the entry's ``object_lock`` status."""
    until = datetime.now(UTC).replace(microsecond=0) + timedelta(days=object_lock.days)
    store.lock([entry_key(job, manifest.iteration, f.path) for f in manifest.files], until)
    return until, {"mode": object_lock.mode, "retain_until": until.isoformat()}


def locked_until(store: ArchiveStore, job: str, iteration: int, status: dict) -> tuple[str, datetime] | None:
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
