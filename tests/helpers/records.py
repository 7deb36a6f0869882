"""Step records in the recorder's format (ckptops_records) with chosen times: a long-running
job's records without running it for hours."""

import json
from pathlib import Path


def write_records(
    path: Path,
    iterations,
    step_seconds: float,
    start: float = 1_000_000.0,
    save_interval: int = 4,
    save_seconds: float = 30.0,
    attempt: str = "a",
) -> Path:
    """One record per iteration, each ``step_seconds`` long; after every ``save_interval``-th
    the loop is held ``save_seconds`` (a blocking save)."""
    now = start
    with open(path, "a") as f:
        for iteration in iterations:
            now += step_seconds
            line = {
                "v": 1,
                "run": "job",
                "attempt": attempt,
                "time": now,
                "iteration": iteration,
                "consumed_samples": iteration * 8,
                "lr": 1e-3,
                "batch": {"position": (iteration - 1) * 8, "count": 8, "digest": f"d{iteration}"},
                "loss": 2.0,
                "grad_norm": 1.0,
                "skipped": 0,
                "nan": 0,
                "tokens": 256,
                "step_seconds": step_seconds,
                "tokens_per_second": 256 / step_seconds,
                "peak_memory_bytes": 1e9,
                "memory_kind": "cuda",
            }
            f.write(json.dumps(line) + "\n")
            if iteration % save_interval == 0:
                now += save_seconds
    return Path(path)
