"""The archive's entries: where an entry's objects are (``<job>/iter_NNNNNNN/<name>``), which
entries are committed (their manifest is there), the pointer object that names the newest, and a
committed entry's manifest read and trusted as the job's ``sign`` section asks, through the one
parse, check and sign path the shared store uses (``tasks.checkpoint.manifest``)."""

from tasks.checkpoint import layout, signing
from tasks.checkpoint.manifest import UNCHECKED, CorruptManifest, Manifest, check_trusted, parse_manifest
from tasks.checkpoint.signing import Trust
from tasks.errors import CkptopsError
from tasks.storage.archive import AccessDenied, ArchiveStore

POINTER_OBJECT = "latest_committed_iteration.txt"


class UnreadableManifest(CkptopsError):
    """An archived manifest that exists but does not parse or may not be read (not an outage)."""


class NoEntry(CkptopsError):
    """No committed manifest at that key (never committed, or removed meanwhile)."""


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


def archived_manifest(store: ArchiveStore, job: str, iteration: int, trust: Trust = UNCHECKED) -> Manifest:
    """A committed entry's manifest, its signature checked as ``trust`` (the job's ``sign``
    section) asks: one that does not verify is unreadable, never used."""
    key = entry_key(job, iteration, layout.MANIFEST)
    try:
        raw = store.read(key)
        manifest = parse_manifest(raw, store.where(key))
    except FileNotFoundError:
        raise NoEntry(f"{store.where(key)}: no committed archive entry") from None
    except (AccessDenied, CorruptManifest) as e:
        raise UnreadableManifest(f"{e} (unreadable archived manifest)") from None
    if trust.checks:
        signature_key = entry_key(job, iteration, layout.SIGNATURE)
        signature = _signature(store, signature_key)
        name = signing.name_of(job, iteration)  # from where it is kept, not from what it says
        try:
            check_trusted(
                manifest, raw, signature, (store.where(key), store.where(signature_key)), trust, name
            )
        except signing.BadSignature as e:
            raise UnreadableManifest(f"{e} (untrusted archived manifest)") from None
    return manifest


def _signature(store: ArchiveStore, key: str) -> bytes | None:
    """An archived manifest's signature; None when there is none (``check_trusted`` judges that)."""
    try:
        return store.read(key)
    except FileNotFoundError:
        return None
    except AccessDenied as e:
        raise UnreadableManifest(f"{e} (unreadable signature)") from None


def by_commit_time(
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
