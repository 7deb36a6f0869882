"""``make bench`` (fourth part): post-resume validation of a million step records, and what the
step recorder costs a training step.

The records are generated in the recorder's format for a long run resumed from the small bench
checkpoint (iteration 4, 8 samples a batch): 900,000 records before the failure and 100,000 after
it (1,000,000 in all), every resumed iteration recomputed and compared. Batches are recorded as a
production run's would be, by digest (a 500B run's global batch is over the 1,024 IDs written in
full). Target: validating 1,000,000 step records in under 5 s. The peak memory of the whole
``ckptops validate-resume`` on those files is measured as a process of its own. The recorder's
cost is measured per call, beside the local job's step time.
"""

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from ckptops_records import StepRecorder, batch_summary
from infra.local_job.launch import run_local_job
from tasks.job.step_records import load_steps
from tasks.profile import load_profile
from tasks.resume.validate import validate_resume
from tests.bench.bench_verify import BENCH, checkpoint

BEFORE, AFTER = 900_000, 100_000
console = Console(highlight=False)


def write_records(path: Path, first: int, last: int, batch: int = 8) -> None:
    losses = 2.5 + np.random.default_rng(7).standard_normal(BEFORE + AFTER + 8) * 0.01
    with open(path, "w") as f:
        for it in range(first, last + 1):
            summary = batch_summary((it - 1) * batch, range((it - 1) * batch, it * batch))
            summary.pop("ids")
            line = {
                "v": 1,
                "run": "bench",
                "attempt": "a",
                "pid": 1,
                "time": 1.0 * it,
                "iteration": it,
                "consumed_samples": it * batch,
                "lr": 1e-3 * (1 - it / (4 * BEFORE)),
                "batch": summary,
                "loss": float(losses[it]),
                "grad_norm": 1.0,
                "skipped": 0,
                "nan": 0,
                "tokens": 256,
                "step_seconds": 0.03,
                "tokens_per_second": 8533.3,
                "tflops": None,
                "peak_memory_bytes": 790_000_000,
                "memory_kind": "cpu_peak_rss",
            }
            f.write(json.dumps(line) + "\n")


def recorder_cost(directory: Path, calls: int = 20_000) -> float:
    recorder = StepRecorder(directory / "cost.jsonl", "bench", "a", 1e9)
    ids = list(range(8))
    started = time.perf_counter()
    for it in range(calls):
        recorder.record(
            iteration=it,
            consumed_samples=it * 8,
            lr=1e-3,
            batch=batch_summary(it * 8, ids),
            loss=2.5,
            grad_norm=1.0,
            skipped=0,
            nan=0,
            tokens=256,
            step_seconds=0.03,
        )
    recorder.close()
    return (time.perf_counter() - started) / calls


def local_step_seconds() -> float:
    """The local job's median step time, from a short run of it with step records."""
    records = BENCH / "steps.jsonl"
    if not records.exists():
        with console.status("a short local training run for its step time..."):
            run_local_job(
                BENCH / "steps", train_iters=20, save_interval=1000, extra=["--step-records", str(records)]
            )
    return statistics.median(
        json.loads(line)["step_seconds"] for line in records.read_text().splitlines()[3:]
    )


def cli_peak_memory(checkpoint: Path, before: Path, after: Path) -> tuple[int, int]:
    """Peak RSS (bytes) of the CLI validating the records, as a process of its own (the first
    child of this process: ru_maxrss of the children is theirs)."""
    cli = Path(sys.executable).with_name("ckptops")
    done = subprocess.run(
        [
            str(cli),
            "validate-resume",
            "--checkpoint",
            str(checkpoint),
            "--before",
            str(before),
            "--after",
            str(after),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode not in (0, 1):
        raise SystemExit(f"validate-resume failed: {done.stderr.strip()}")
    return resource.getrusage(
        resource.RUSAGE_CHILDREN
    ).ru_maxrss * 1024, before.stat().st_size + after.stat().st_size


def main() -> int:
    ckpt = checkpoint("small", 4, [])
    with tempfile.TemporaryDirectory(prefix="ckptops-bench-resume-") as tmp:
        tmp = Path(tmp)
        with console.status(f"writing {BEFORE + AFTER:,} step records..."):
            write_records(tmp / "before.jsonl", 1, BEFORE)
            write_records(tmp / "after.jsonl", 5, AFTER + 4)
        settings = load_profile().resume
        started = time.perf_counter()
        before = load_steps(tmp / "before.jsonl")
        after = load_steps(tmp / "after.jsonl")
        loaded = time.perf_counter() - started
        result = validate_resume(ckpt, before, after, settings)
        total = time.perf_counter() - started
        per_call = recorder_cost(tmp)
        peak_rss, sizes = cli_peak_memory(ckpt, tmp / "before.jsonl", tmp / "after.jsonl")
    step = local_step_seconds()
    table = Table(title="make bench: post-resume validation")
    for column in ("what", "value"):
        table.add_column(column)
    table.add_row(
        "records validated", f"{len(before) + len(after):,} ({len(before):,} before, {len(after):,} after)"
    )
    table.add_row("load (parse both files)", f"{loaded:.2f} s")
    table.add_row("load + all checks", f"{total:.2f} s")
    table.add_row("verdict", result.line()[:80])
    table.add_row(
        "ckptops validate-resume, peak memory",
        f"{peak_rss / 2**20:.0f} MiB for {sizes / 2**20:.0f} MiB of records "
        "(the whole CLI, torch imports included)",
    )
    table.add_row(
        "recorder, per step",
        f"{per_call * 1e6:.0f} us = {per_call / step:.2%} of a {step * 1000:.0f} ms local step",
    )
    console.print(table)
    per_million = total / (len(before) + len(after)) * 1_000_000  # the same as total: a million in all
    console.print(
        f"{per_million:.2f} s per million records (target < 5 s): {'met' if per_million < 5 else 'NOT met'}; "
        f"recorder {per_call / step:.2%} of a step (target < 1%)"
    )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
