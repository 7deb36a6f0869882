"""The catalog: every checkpoint in a save directory with its state, derived on demand.

It owns no file. A checkpoint's state comes from its manifest (the verifier's) and a cheap
completeness check (stat only); "promoted" from the pointer; pins from the pin folder. Deriving
it each time means it can never disagree with the files it describes. A manifest the verdict log
does not vouch for (``manifest.UnboundVerdict``: the log deleted or shortened) says nothing: its
checkpoint is listed as needing verification again, with a warning, and never promoted first.
"""

import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.manifest import CorruptManifest, UnboundVerdict, read_manifest
from tasks.checkpoint.pins import expired_leases
from tasks.checkpoint.pins import pins as read_pins
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.state import State, VerifyOptions, completeness
from tasks.errors import UsageError, unreadable
from tasks.outcome import Outcome
from tasks.storage.local import list_entries, list_files

_FROM_DISK = object()

log = logging.getLogger(__name__)


@dataclass
class CheckpointInfo:
    iteration: int
    directory: str
    state: State
    reason: str
    size_bytes: int
    verified_at: str | None = None
    checked_at: str | None = None
    consumed_train_samples: int | None = None
    promoted: bool = False
    pins: list[str] = field(default_factory=list)
    stale: bool = False  # re-saved after verification: the manifest describes an older save
    manifest_error: str | None = None  # its manifest cannot be trusted (a human must look)
    expired_pins: list[str] = field(
        default_factory=list
    )  # leases whose reader is gone (removed by retention)
    warnings: list[str] = field(default_factory=list)  # checks passed with a warning (a norm drift)
    optimizer_step: int | None = None
    # Its newest continuation drill: True, certified (it resumes as the original run went on);
    # False, it loads but does not resume; None, never continued.
    certified: bool | None = None
    certification: str = ""  # what that drill said
    unbound: str | None = None  # why its manifest's verdict is not trusted: it is verified again

    def to_dict(self) -> dict:
        return asdict(self)


def describe(
    directory: Path, options: VerifyOptions, entries: dict[str, os.stat_result] | None = None
) -> CheckpointInfo:
    """The checkpoint's state from its files (``entries``: its ``list_entries``, when the caller
    has just taken them: one listing per checkpoint) and its manifest."""
    iteration = layout.parse_iter_dir(directory.name)
    try:
        files = list_files(directory, entries)
    except OSError as e:
        raise unreadable(directory, e) from None
    info = CheckpointInfo(
        iteration,
        directory.name,
        State.UNVERIFIED,
        "complete, not verified yet",
        sum(st.st_size for st in files.values()),
    )
    progress = completeness(directory, options, files)
    if progress.state is State.IN_PROGRESS:
        info.state, info.reason = progress.state, progress.reason
        return info
    try:
        manifest = read_manifest(directory, options.trust)
    except UnboundVerdict as e:
        info.stale, info.unbound = True, str(e)
        info.reason = f"needs verifying again: {str(e).split(': ', 1)[-1]}"
        return info
    except CorruptManifest as e:
        info.state, info.reason, info.manifest_error = State.INVALID, str(e), str(e)
        return info
    if manifest is not None and manifest.iteration != iteration:
        info.state, info.reason = (
            State.INVALID,
            f"{layout.MANIFEST}: describes iteration {manifest.iteration}",
        )
    elif manifest is not None and not manifest.same_save(files):
        info.stale, info.reason = (
            True,
            f"re-saved since it was found {manifest.status}; needs verifying again",
        )
    elif manifest is not None:
        info.state, info.reason = manifest.status, manifest.reason
        info.verified_at, info.checked_at = manifest.verified_at, manifest.checked_at
        info.consumed_train_samples = manifest.consumed_train_samples
        info.optimizer_step = manifest.optimizer_step
        info.warnings = [f"{c.detail} [{c.name}]" for c in manifest.checks if c.outcome == Outcome.WARN]
        info.certified = manifest.resumes
        if info.certified is not None:
            info.certification = str(manifest.certification.get("detail", ""))
    elif progress.state is State.INVALID:
        info.state, info.reason = progress.state, progress.reason
    return info


def catalog(
    save_dir: Path,
    options: VerifyOptions,
    pointer=_FROM_DISK,
    listings: dict[int, dict[str, os.stat_result]] | None = None,
) -> list[CheckpointInfo]:
    """Every checkpoint in ``save_dir``, oldest first. ``pointer``: the promoted iteration when
    the caller has read it already (``status`` lists the checkpoints even when the pointer file
    is garbled); by default it is read here, and a garbled one is an error. ``listings``, if
    given, receives each checkpoint directory's ``list_entries``, for the caller's own checks."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        raise UsageError(f"{save_dir}: no such save directory")
    try:
        iterations = layout.list_iterations(save_dir)
    except OSError as e:
        raise unreadable(save_dir, e) from None
    if pointer is _FROM_DISK:
        pointer = read_pointer(save_dir)
    pinned = read_pins(save_dir)
    expired: dict[int, list[str]] = {}
    for lease, why in expired_leases(save_dir):
        expired.setdefault(lease.iteration, []).append(f"{lease.holder} ({why})")
    infos = []
    for iteration in iterations:
        directory = save_dir / layout.iter_dir_name(iteration)
        try:
            entries = list_entries(directory)
            info = describe(directory, options, entries)
        except FileNotFoundError:
            continue  # deleted by retention while we listed
        except OSError as e:
            raise unreadable(directory, e) from None
        if listings is not None:
            listings[iteration] = entries
        info.promoted = iteration == pointer
        info.pins = sorted(pinned.get(iteration, []))
        info.expired_pins = expired.get(iteration, [])
        infos.append(info)
    unbound = [i for i in infos if i.unbound]
    if unbound:
        log.warning(
            "%s: %d manifest(s) not bound to the verdict log (iterations %s): verified again before "
            "any is promoted; first: %s",
            save_dir,
            len(unbound),
            ", ".join(str(i.iteration) for i in unbound),
            unbound[0].unbound,
        )
    return infos


def resumable(infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """The checkpoints a run may resume from, newest first: valid by a manifest of the very save
    now on disk. What promotion may point at, and what a recovery chooses from."""
    return sorted((i for i in infos if i.state is State.VALID and not i.stale), key=lambda i: -i.iteration)
