"""Archive retention: which committed entries go after a copy, how an entry is removed (its commit
marker first, then its objects, every version of them on an Object Lock archive), and the
uncommitted leftovers of killed runs older than the newest commit."""

from datetime import UTC, datetime, timedelta

from tasks.archive.commit import uncommit
from tasks.archive.entries import by_commit_time, committed_iterations, entry_key, newest_committed
from tasks.archive.protect import locked_until
from tasks.checkpoint import layout
from tasks.checkpoint.manifest import UNCHECKED
from tasks.checkpoint.signing import Trust
from tasks.storage.archive import ArchiveStore


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
    statuses = by_commit_time(store, job, committed, trust)[0]
    by_commit = list(statuses)
    named = newest_committed(store, job)
    deleted, notes = [], notes if notes is not None else []
    young = datetime.now(UTC) - timedelta(days=keep_days or 0)
    for iteration in by_commit[:-keep] if len(by_commit) > keep else []:
        if iteration == named or iteration in pinned_iterations:
            continue
        if keep_days is not None and datetime.fromisoformat(statuses[iteration]["committed_at"]) > young:
            continue
        locked = locked_until(store, job, iteration, statuses[iteration])
        if locked is not None:
            notes.append(
                f"archive copy of iteration {iteration} kept: Object Lock ({locked[0]}) until "
                f"{locked[1].isoformat(timespec='seconds')}; archive retention can delete it from then"
            )
            continue
        _remove_entry(store, job, iteration, statuses[iteration])
        deleted.append(iteration)
    _remove_leftovers(store, job, committed)
    return deleted


def _remove_entry(store: ArchiveStore, job: str, iteration: int, status: dict) -> None:
    uncommit(store, job, iteration)
    if status.get("object_lock") and not store.is_local:
        store.remove_versions(entry_key(job, iteration))
    else:
        store.remove(entry_key(job, iteration), recursive=True)


def _remove_leftovers(store: ArchiveStore, job: str, committed: list[int]) -> None:
    """Prefixes without a commit marker below the newest committed iteration: what killed runs left."""
    newest = max(committed) if committed else None
    for name in store.listdir(job):
        iteration = layout.parse_iter_dir(name)
        if iteration is not None and newest is not None and iteration < newest and iteration not in committed:
            store.remove(entry_key(job, iteration), recursive=True)
