"""Megatron-LM's on-disk layout and the names ckptops adds to it.

<save>/latest_checkpointed_iteration.txt   Megatron-LM's tracker (Megatron's; never written here)
<save>/latest_verified_iteration.txt       ckptops' promotion pointer
<save>/iter_0000100/                       one checkpoint
    metadata.json  .metadata  __<rank>_<n>.distcp  [integrity.json]  manifest.json (ckptops)
"""

import os
import re
from pathlib import Path

from tasks.storage.local import TEMP_MARK

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
POINTER = "latest_verified_iteration.txt"
LOCK = ".ckptops.lock"
ARCHIVE_LOCK = ".ckptops-archive.lock"
RECOVERY_LOCK = ".ckptops-recovery.lock"
PINS = ".ckptops-pins"
HISTORY = ".ckptops-history"

METADATA_JSON = "metadata.json"
DCP_METADATA = ".metadata"
INTEGRITY_JSON = "integrity.json"
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"  # tasks.checkpoint.signing
DATA_SUFFIX = ".distcp"
KNOWN_BACKENDS = {"torch_dist"}

_ITER_DIR = re.compile(r"^iter_(\d{7,})$", re.ASCII)
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$", re.ASCII)  # __<rank>_<n>.distcp


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def parse_iter_dir(name: str) -> int | None:
    """The iteration of a directory named exactly as Megatron names it (``iter_00000099`` with
    an extra digit is not iteration 99: Megatron would never load it)."""
    match = _ITER_DIR.match(name)
    if not match:
        return None
    iteration = int(match.group(1))
    return iteration if iter_dir_name(iteration) == name else None


def list_iterations(save_dir: Path) -> list[int]:
    """Iterations with a checkpoint directory, oldest first.

    Symlinks are not checkpoints: ``iter_0000012 -> iter_0000004`` would let iteration 4's
    state be promoted and resumed as iteration 12.
    """
    found = []
    with os.scandir(save_dir) as entries:
        for entry in entries:
            iteration = parse_iter_dir(entry.name)
            try:
                if iteration is not None and entry.is_dir(follow_symlinks=False):
                    found.append(iteration)
            except FileNotFoundError:
                continue
    return sorted(found)


def writing_ranks(names) -> set[int]:
    """The ranks whose data files (``__<rank>_<n>.distcp``) are among ``names``."""
    return {int(m[1]) for name in names if (m := _DATA_FILE.match(name))}


CORE_FILES = (METADATA_JSON, DCP_METADATA)


def is_own_file(name: str) -> bool:
    """Files ckptops writes into a checkpoint: never part of what is verified."""
    return name in (MANIFEST, SIGNATURE) or name.startswith((MANIFEST + TEMP_MARK, SIGNATURE + TEMP_MARK))


def is_checkpoint_content(name: str) -> bool:
    """Files Megatron's save itself writes, which no later step may add or change."""
    return name in CORE_FILES or name.endswith(DATA_SUFFIX)
