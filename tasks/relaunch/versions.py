"""The relaunch environment's versions, as the job's own Python reports them: megatron-core,
torch, CUDA and NCCL, asked with the command that starts it (``recovery.job_python``: a venv's
python, or srun into the job's container), bounded by a timeout."""

import json

from tasks.cluster import process

# What the job's Python reports of itself: run with recovery.job_python, bounded by a timeout.
VERSIONS_SNIPPET = """
import json, importlib.metadata as m
found = {}
for key, dist in (("megatron_core", "megatron-core"), ("torch", "torch")):
    try:
        found[key] = m.version(dist)
    except m.PackageNotFoundError:
        found[key] = None
try:
    import torch
    found["cuda"] = torch.version.cuda
    found["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
except Exception:
    found["cuda"] = found["nccl"] = None
print(json.dumps(found))
"""


def job_versions(job_python: list[str], timeout_seconds: float) -> dict:
    """megatron-core, torch, CUDA and NCCL as the job's own Python reports them (the command
    that starts it: a venv's python, or srun into the job's container); ``{"error": why}`` if
    it cannot say."""
    output = process.capture([*job_python, "-c", VERSIONS_SNIPPET], timeout_seconds)
    if output.timed_out:
        return {"error": f"{job_python[0]} timed out after {timeout_seconds:.0f}s"}
    if output.exit_code != 0:
        last = (output.stderr.strip().splitlines() or [""])[-1]
        return {"error": f"{job_python[0]} exited {output.exit_code}: {last[:200]}"}
    try:
        found = json.loads(output.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"{job_python[0]} printed no versions"}
    return found if isinstance(found, dict) else {"error": f"{job_python[0]} printed no versions"}


# How long the job's Python may take to say its versions (recovery.job_python; srun may queue).
JOB_PYTHON_TIMEOUT_SECONDS = 120.0
