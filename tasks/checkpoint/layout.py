"""Megatron-LM's on-disk layout and the names ckptops adds to it.

    <save>/latest_checkpointed_iteration.txt   Megatron-LM's tracker (Megatron's; never written here)
    <save>/latest_verified_iteration.txt       ckptops' promotion pointer
    <save>/iter_0000100/                       one checkpoint
        metadata.json  .metadata  __<rank>_<n>.distcp  [integrity.json]  manifest.json (ckptops)
"""

import re
from pathlib import Path

from tasks.storage.local import TEMP_MARK

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
POINTER = "latest_verified_iteration.txt"
LOCK = ".ckptops.lock"
PINS = ".ckptops-pins"

METADATA_JSON = "metadata.json"
DCP_METADATA = ".metadata"
INTEGRITY_JSON = "integrity.json"
MANIFEST = "manifest.json"
DATA_SUFFIX = ".distcp"
KNOWN_BACKENDS = {"torch_dist"}

_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def parse_iter_dir(name: str) -> int | None:
    match = _ITER_DIR.match(name)
    return int(match.group(1)) if match else None


def list_iterations(save_dir: Path) -> list[int]:
    """Iterations with a checkpoint directory, oldest first."""
    found = []
    for entry in Path(save_dir).iterdir():
        iteration = parse_iter_dir(entry.name)
        if iteration is not None and entry.is_dir():
            found.append(iteration)
    return sorted(found)


def is_own_file(name: str) -> bool:
    """Files ckptops writes into a checkpoint: never part of what is verified."""
    return name == MANIFEST or name.startswith(MANIFEST + TEMP_MARK)
