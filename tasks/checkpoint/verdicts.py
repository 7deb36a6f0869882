"""The verdict log: each manifest ckptops wrote for a save directory's checkpoints, numbered, so
that a manifest put back (a copy kept from before re-verification found the checkpoint invalid,
with its signature) is never trusted again.

``<save>/.ckptops-history/verdicts.jsonl``, one line per manifest written:
``{"iteration": 24, "verdict": 3, "status": "invalid", "sha256": "...", "at": "..."}``.

A manifest carries its number (``Manifest.verdict``): one more than the newest recorded for its
iteration and than the manifest it replaces. A signed manifest carries it under its signature
(manifest.json's own digest is a signed subject), so a number cannot be raised without the key.
A manifest is trusted only if its number is not below the newest recorded for its iteration. A
number above it is a manifest whose line a crash or a full disk lost between its rename and the
append: newer, not older, and trusted. A manifest edited in place keeps its number: what catches
that is its signature, as before (an unsigned manifest vouches for nothing against whoever can
write it). Each line keeps the SHA-256 of the manifest it records, for a human comparing copies.
Writing the log needs what the save directory needs: whoever can write it decides what a recovery
resumes from, so promotion refuses it if others can (``access``).
"""

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from tasks.checkpoint import layout
from tasks.errors import unreadable
from tasks.storage.local import append_jsonl, own_folder, read_jsonl

VERDICTS = "verdicts.jsonl"


@dataclass(frozen=True)
class Verdict:
    iteration: int
    number: int
    status: str
    at: str


def log_path(save_dir: Path) -> Path:
    return Path(save_dir) / layout.HISTORY / VERDICTS


def _fits(entry: dict) -> bool:
    return (
        all(type(entry.get(k)) is int for k in ("iteration", "verdict"))
        and isinstance(entry.get("status", ""), str)
        and isinstance(entry.get("at", ""), str)
    )


# The newest verdict of each iteration, by log, while the log is unchanged: a catalog reads every
# manifest, and each read checks its number against the log.
_CACHE: dict[str, tuple[tuple, dict[int, Verdict]]] = {}


def _newest_by_iteration(save_dir: Path) -> dict[int, Verdict]:
    path = log_path(save_dir)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise unreadable(path, e) from None
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _CACHE.get(str(path))
    if cached is not None and cached[0] == key:
        return cached[1]
    newest: dict[int, Verdict] = {}
    for entry in read_jsonl(path, fits=_fits):
        found = Verdict(entry["iteration"], entry["verdict"], entry.get("status", ""), entry.get("at", ""))
        if found.iteration not in newest or found.number >= newest[found.iteration].number:
            newest[found.iteration] = found
    _CACHE[str(path)] = (key, newest)
    return newest


def newest(save_dir: Path, iteration: int) -> Verdict | None:
    """The newest verdict recorded for checkpoint ``iteration`` of this save directory."""
    return _newest_by_iteration(save_dir).get(iteration)


def next_number(save_dir: Path, iteration: int, replaced: int | None) -> int:
    """The number of a new verdict of ``iteration``: past the newest recorded and past the number
    of the manifest it replaces (``replaced``; its line may have been lost)."""
    recorded = newest(save_dir, iteration)
    return max(recorded.number if recorded else 0, replaced or 0) + 1


def record(save_dir: Path, iteration: int, number: int, status: str, data: bytes, at: str) -> None:
    """Append the verdict just written (``data``: the manifest's exact bytes)."""
    path = own_folder(save_dir, layout.HISTORY) / VERDICTS
    entry = {
        "iteration": iteration,
        "verdict": number,
        "status": status,
        "sha256": hashlib.sha256(data).hexdigest(),
        "at": at,
    }
    try:
        append_jsonl(path, entry)
    except OSError as e:
        raise unreadable(path, e) from None


def put_back(save_dir: Path, iteration: int, number: int | None) -> str | None:
    """Why a manifest of ``iteration`` (its verdict ``number``; None in one written before the
    log) is older than the newest verdict the log records for it, or None if it is not."""
    recorded = newest(save_dir, iteration)
    if recorded is None or (number is not None and number >= recorded.number):
        return None
    mine = "no verdict number" if number is None else f"verdict {number}"
    then = f"verdict {recorded.number} ({recorded.status or 'unknown'}, {recorded.at or 'time unknown'})"
    return (
        f"an older manifest put back: it is {mine}, {layout.HISTORY}/{VERDICTS} records {then} since; "
        "never trusted"
    )
