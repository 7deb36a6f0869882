"""The manifest: what a verified checkpoint is, written into it as ``manifest.json``.

The verifier owns this file and is its only writer. Its ``files`` are the reference every later
re-verification, copy and restore compares against; they are taken from the first verification
that passed and never replaced afterwards (a failing re-verification changes ``status`` and
``checks`` but keeps the reference, so the evidence of what the bytes should be survives).
"""

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from tasks import __version__
from tasks.checkpoint.layout import CORE_FILES, MANIFEST
from tasks.errors import CkptopsError, unreadable
from tasks.storage.local import atomic_write

SCHEMA_VERSION = 1
HASH_ALGORITHM = "xxh3-128"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


@dataclass
class FileEntry:
    path: str
    size: int
    hash: str


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str
    file: str | None = None


@dataclass
class Manifest:
    job: str
    iteration: int
    status: str
    reason: str
    consumed_train_samples: int | None
    writer: dict
    layout: dict
    files: list[FileEntry]
    totals: dict
    checks: list[CheckResult]
    verified_at: str | None
    checked_at: str
    save_identity: dict = field(default_factory=dict)
    verifier: dict = field(default_factory=lambda: {"ckptops": __version__, "host": socket.gethostname()})
    hash_algorithm: str = HASH_ALGORITHM
    archive: dict | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def valid(self) -> bool:
        return self.status == "valid"

    def same_save(self, files: dict[str, os.stat_result]) -> bool:
        """Whether the checkpoint is still the save this manifest describes.

        Megatron re-saving into the directory rewrites metadata.json and .metadata; a flipped
        bit or a truncation does not. Size and mtime, not the inode, so that a copy made with
        its times kept (a restore) is still recognised as the same save.
        """
        return self.save_identity == save_identity(files)

    def file_map(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        data = dict(data)
        data["files"] = [FileEntry(**f) for f in data["files"]]
        data["checks"] = [CheckResult(**c) for c in data["checks"]]
        return cls(**data)


def save_identity(files: dict[str, os.stat_result]) -> dict:
    """What identifies one save of a checkpoint directory (see ``Manifest.same_save``)."""
    return {name: [files[name].st_size, files[name].st_mtime_ns] for name in CORE_FILES if name in files}


def read_manifest(directory: Path) -> Manifest | None:
    """The checkpoint's manifest, or None if it has never been verified."""
    path = Path(directory) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except OSError as e:
        raise unreadable(path, e) from None
    except ValueError as e:
        raise CkptopsError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        raise CkptopsError(
            f"{path}: unknown manifest schema "
            f"{data.get('schema_version') if isinstance(data, dict) else None!r}"
        )
    try:
        return Manifest.from_dict(data)
    except (TypeError, KeyError) as e:
        raise CkptopsError(f"{path}: malformed manifest ({e})") from None


def write_manifest(directory: Path, manifest: Manifest) -> None:
    path = Path(directory) / MANIFEST
    try:
        atomic_write(path, manifest.to_json().encode())
    except OSError as e:
        raise unreadable(path, e) from None


def record_archive_status(directory: Path, status: dict) -> None:
    """Note in the shared-store manifest where and when the checkpoint was archived (the caller
    holds the job lock, so this read-modify-write cannot interleave with a verification)."""
    manifest = read_manifest(directory)
    if manifest is None:
        raise CkptopsError(f"{Path(directory) / MANIFEST}: missing, cannot record the archive copy")
    manifest.archive = status
    write_manifest(directory, manifest)
