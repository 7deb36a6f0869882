"""ckptops' step recorder: what a training job imports, and nothing else of ckptops.

    from ckptops_records import StepRecorder, batch_summary

A training loop calls ``StepRecorder.record(...)`` once per step on one rank. Each line holds what
a resumed run must reproduce (iteration, consumed samples, learning rate, the global batch,
loss, grad norm) and what it must not lose (throughput, peak memory, skipped and NaN
iterations), with the run and attempt ids.

The global batch: the sampler's position range (where in the data order the batch starts, and
how many samples) and the dataset sample IDs. IDs are written in full up to ``FULL_IDS`` (1024)
per batch; every record also carries their count, first, last and an XXH3-64 digest of the IDs
as int64, so batches of any size compare exactly and a 500B run's records stay small.

Peak memory is per step: ``torch.cuda.max_memory_allocated`` reset every step on a GPU; on CPU
the process's peak RSS (``VmHWM``), reset every step through ``/proc/self/clear_refs``.

A module of its own, under a name no training code uses: Megatron-LM's repository has a
top-level ``tasks`` package of its own, so importing ckptops' ``tasks`` inside a training job
would shadow it, or be shadowed, depending on the working directory. This module imports
nothing of ckptops, and only numpy and xxhash (torch where it measures GPU memory).
"""

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import xxhash

SCHEMA = 1
FULL_IDS = 1024


def batch_summary(first_position: int, sample_ids) -> dict:
    ids = np.asarray(sample_ids, dtype=np.int64)
    summary = {
        "position": int(first_position),
        "count": int(ids.size),
        "first": int(ids[0]) if ids.size else None,
        "last": int(ids[-1]) if ids.size else None,
        "digest": xxhash.xxh3_64_hexdigest(ids.tobytes()),
    }
    if ids.size <= FULL_IDS:
        summary["ids"] = ids.tolist()
    return summary


class _PeakMemory:
    """Peak memory during one step, on GPU or CPU."""

    def __init__(self):
        import torch

        self.cuda = torch.cuda.is_available()
        self.torch = torch
        self.kind = "cuda_max_allocated" if self.cuda else "cpu_peak_rss"

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM, the peak RSS
        except OSError:
            pass

    def read(self) -> int | None:
        if self.cuda:
            return int(self.torch.cuda.max_memory_allocated())
        try:
            with open("/proc/self/status") as f:
                match = re.search(r"VmHWM:\s+(\d+) kB", f.read())
            return int(match.group(1)) * 1024 if match else None
        except OSError:
            return None


class StepRecorder:
    """Writes step records (call ``record`` once per step on one rank; ``None`` path: off)."""

    def __init__(
        self, path: str | Path | None, run_id: str, attempt_id: str, flops_per_step: float | None = None
    ):
        self.path, self.run_id, self.attempt_id = path, run_id, attempt_id
        self.flops_per_step = flops_per_step
        # Open for the whole run (closed by close()); line-buffered: a crash loses one line at most.
        self.file = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self.memory = _PeakMemory()
        self.memory.reset()

    def record(
        self,
        *,
        iteration: int,
        consumed_samples: int,
        lr: float,
        batch: dict,
        loss: float,
        grad_norm: float | None,
        skipped: int,
        nan: int,
        tokens: int,
        step_seconds: float,
    ) -> None:
        if self.file is None:
            return
        line = {
            "v": SCHEMA,
            "run": str(self.run_id),
            "attempt": str(self.attempt_id),
            "pid": os.getpid(),
            "time": time.time(),
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "lr": lr,
            "batch": batch,
            "loss": loss,
            "grad_norm": grad_norm,
            "skipped": skipped,
            "nan": nan,
            "tokens": tokens,
            "step_seconds": step_seconds,
            "tokens_per_second": tokens / step_seconds if step_seconds > 0 else None,
            "tflops": self.flops_per_step / step_seconds / 1e12
            if self.flops_per_step and step_seconds > 0
            else None,
            "peak_memory_bytes": self.memory.read(),
            "memory_kind": self.memory.kind,
        }
        self.file.write(json.dumps(line) + "\n")
        self.memory.reset()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
