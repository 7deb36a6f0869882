"""The verdict log: each manifest ckptops wrote for a save directory's checkpoints, numbered, so
that a manifest put back (a copy kept from before re-verification found the checkpoint invalid,
with its signature) is never trusted again.

``<save>/.ckptops-history/verdicts.jsonl``, one line per manifest written:
``{"iteration": 24, "verdict": 3, "sequence": 41, "status": "invalid", "sha256": "...", "at": "..."}``.

A manifest carries two numbers, both under its signature where it is signed (manifest.json's own
digest is a signed subject), so neither can be changed without the key:

- ``Manifest.verdict``: one more than the newest recorded for its iteration and than the
  manifest it replaces. A manifest whose number is below the newest recorded for its iteration
  is one put back: never trusted (``put_back``).
- ``Manifest.sequence``: its line's place in the whole log, one more than the log's last (and
  than the manifest it replaces). A manifest is bound to the log when the log holds its sequence
  for its iteration with the SHA-256 of its very bytes (``unbound``). For the job's own save
  directory (a ``Trust`` naming the job) a manifest that is not bound is never trusted on its
  word: its checkpoint is verified again, every byte, and gets a new bound manifest. That covers
  the log deleted, shortened or rewritten under a manifest put back, and a line a crash or a full
  disk lost after its manifest's rename (the manifest is not promoted on its own word: its
  checkpoint is verified again once the log can be written). Under ``sign.required`` a manifest
  written before sequences (none) is verified again too; without it, it is read as before,
  against the verdict numbers alone.

What this cannot see: a log cut exactly after the line of the manifest put back (its own line
kept, every later one gone) reads as a log that was never longer; whoever can rewrite the log and
the manifests together can choose among the manifests we signed. The log is among the paths
promotion refuses when others can write it (``access``).
"""

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from tasks.checkpoint import layout
from tasks.errors import unreadable
from tasks.storage.local import append_jsonl, own_folder, read_jsonl

VERDICTS = "verdicts.jsonl"
_WHERE = f"{layout.HISTORY}/{VERDICTS}"


@dataclass(frozen=True)
class Verdict:
    iteration: int
    number: int
    status: str
    at: str


@dataclass
class _Log:
    """What the readers ask of one version of the log."""

    present: bool = False
    newest: dict[int, Verdict] = field(default_factory=dict)  # by iteration
    lines: dict[int, tuple[int, str]] = field(default_factory=dict)  # sequence: (iteration, sha256)
    last: int = 0  # the highest sequence it holds


def log_path(save_dir: Path) -> Path:
    return Path(save_dir) / layout.HISTORY / VERDICTS


def _fits(entry: dict) -> bool:
    return (
        all(type(entry.get(k)) is int for k in ("iteration", "verdict"))
        and type(entry.get("sequence", 0)) is int
        and all(isinstance(entry.get(k, ""), str) for k in ("status", "at", "sha256"))
    )


# The log as read, by path, while its file is unchanged: a catalog reads every manifest, and
# each read checks its numbers against the log.
_CACHE: dict[str, tuple[tuple, _Log]] = {}


def _read(save_dir: Path) -> _Log:
    path = log_path(save_dir)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return _Log()
    except OSError as e:
        raise unreadable(path, e) from None
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _CACHE.get(str(path))
    if cached is not None and cached[0] == key:
        return cached[1]
    log = _Log(present=True)
    for entry in read_jsonl(path, fits=_fits):
        found = Verdict(entry["iteration"], entry["verdict"], entry.get("status", ""), entry.get("at", ""))
        if found.iteration not in log.newest or found.number >= log.newest[found.iteration].number:
            log.newest[found.iteration] = found
        sequence = entry.get("sequence")
        if sequence is not None:
            log.lines[sequence] = (found.iteration, entry.get("sha256", ""))
            log.last = max(log.last, sequence)
    _CACHE[str(path)] = (key, log)
    return log


def newest(save_dir: Path, iteration: int) -> Verdict | None:
    """The newest verdict recorded for checkpoint ``iteration`` of this save directory."""
    return _read(save_dir).newest.get(iteration)


def next_number(save_dir: Path, iteration: int, replaced: int | None) -> int:
    """The number of a new verdict of ``iteration``: past the newest recorded and past the number
    of the manifest it replaces (``replaced``)."""
    recorded = newest(save_dir, iteration)
    return max(recorded.number if recorded else 0, replaced or 0) + 1


def next_sequence(save_dir: Path, replaced: int | None) -> int:
    """The sequence of a new line of the log: past its last and past the sequence of the manifest
    it replaces (``replaced``), so that a manifest never takes the place of an older one's."""
    return max(_read(save_dir).last, replaced or 0) + 1


def record(
    save_dir: Path, iteration: int, number: int, sequence: int, status: str, data: bytes, at: str
) -> None:
    """Append the verdict just written (``data``: the manifest's exact bytes)."""
    path = own_folder(save_dir, layout.HISTORY) / VERDICTS
    entry = {
        "iteration": iteration,
        "verdict": number,
        "sequence": sequence,
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
    return f"an older manifest put back: it is {mine}, {_WHERE} records {then} since; never trusted"


def unbound(save_dir: Path, iteration: int, sequence: int | None, data: bytes, required: bool) -> str | None:
    """Why a manifest of ``iteration`` (its ``sequence``, its exact bytes ``data``) is not bound
    to the log, so that its verdict is not to be taken on its word; None if it is bound, or if it
    predates sequences and ``required`` (``sign.required``) is not set."""
    again = "its verdict is not trusted; the checkpoint is verified again"
    if sequence is None:
        if not required:
            return None
        return f"written before verdict sequences, and sign.required is set: {again}"
    log = _read(save_dir)
    line = log.lines.get(sequence)
    if not log.present:
        why = f"{_WHERE} is missing"
    elif line is None and sequence > log.last:
        why = f"{_WHERE} ends at sequence {log.last}, below this manifest's {sequence} (shortened)"
    elif line is None:
        why = f"{_WHERE} has no line of sequence {sequence} (a line removed)"
    elif line != (iteration, hashlib.sha256(data).hexdigest()):
        what = "another manifest" if line[0] == iteration else f"iteration {line[0]}"
        why = f"{_WHERE} records sequence {sequence} for {what}"
    else:
        return None
    return f"verdict sequence {sequence} not bound to the log: {why}; {again}"
