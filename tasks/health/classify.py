"""One saved ``dcgmi diag`` or ``all_reduce_perf`` output, handed over by a user, classified as a
node's answer would be: ``ckptops health classify``."""

import os
from pathlib import Path

from tasks.errors import UsageError, unreadable
from tasks.health.dcgm import UnexpectedDocument, classify_diag
from tasks.health.nccl import Gates, classify_allreduce
from tasks.health.verdict import HealthCheck
from tasks.storage.local import open_regular

# Real DCGM and nccl-tests outputs are kilobytes; a file far larger is not one (and would cost
# gigabytes to parse).
MAX_TOOL_OUTPUT = 64 << 20
TOOLS = ("dcgm", "nccl")


def _read_output(path: Path) -> str:
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_TOOL_OUTPUT:
                raise UsageError(
                    f"{path}: {size / 2**20:.0f} MiB is more than any dcgmi or all_reduce_perf "
                    f"output (at most {MAX_TOOL_OUTPUT >> 20} MiB are read)"
                )
            return f.read(MAX_TOOL_OUTPUT).decode(errors="replace")
    except OSError as e:
        raise unreadable(path, e) from None


def classify_file(
    tool: str, path: Path, exit_code: int | None, level: int | None, gates: Gates
) -> HealthCheck:
    """The verdict on the output saved in ``path``: dcgm checks the test set of ``level``, and
    a document of a shape DCGM does not write is a usage error (the user handed over the wrong
    file); nccl gates busbw with ``gates`` (the one-node gate or the several-nodes one, by the
    hosts in the output's rank table)."""
    if tool not in TOOLS:
        raise UsageError(f"{tool!r}: classify dcgm or nccl")
    text = _read_output(path)
    try:
        if tool == "dcgm":
            return classify_diag(text, exit_code, level, strict=True)
        return classify_allreduce(text, exit_code, gates)
    except UnexpectedDocument as e:
        raise UsageError(f"{path}: not a DCGM diag document: {e}") from None
