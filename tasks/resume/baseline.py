"""The steady state before a failure, kept with the job: throughput and peak memory over the
last steps after warm-up, compared with the resumed run's (tasks.resume.checks). It is stored in
``.ckptops-history/resume-baseline.json`` so a later validation still has it when the old records
are gone.
"""

import json
from pathlib import Path

import numpy as np

from tasks.checkpoint import layout
from tasks.checkpoint.facts import CheckpointFacts
from tasks.checkpoint.manifest import now_iso
from tasks.errors import Malformed
from tasks.job.step_records import Steps
from tasks.storage.local import atomic_write, own_folder, read_json_state

BASELINE = "resume-baseline.json"


def finite(values: np.ndarray) -> np.ndarray:
    return values[~np.isnan(values)]


def median(values: np.ndarray) -> float | None:
    values = finite(np.asarray(values, dtype=np.float64))
    return float(np.median(values)) if values.size else None


def throughput_of(steps: Steps, facts: CheckpointFacts) -> tuple[np.ndarray, str]:
    """Throughput in tokens/s wherever it can be: Megatron-LM logs give samples/s, and the
    checkpoint's sequence length turns them into tokens/s, comparable with step records."""
    if steps.throughput_unit == "samples/s" and facts.seq_length:
        return steps.throughput * facts.seq_length, "tokens/s"
    return steps.throughput, steps.throughput_unit


def make_baseline(before: Steps, facts: CheckpointFacts, settings) -> dict:
    """The steady state before the failure: the last ``window_steps`` steps after warm-up."""
    rows = np.arange(len(before))[settings.warmup_steps :][-settings.window_steps :]
    throughput, unit = throughput_of(before, facts)
    return {
        "created_at": now_iso(),
        "source": before.source,
        "checkpoint_iteration": facts.iteration,
        "iterations": [int(before.iteration[rows[0]]), int(before.iteration[rows[-1]])]
        if rows.size
        else None,
        "throughput_median": median(throughput[rows]),
        "throughput_unit": unit,
        "peak_memory_median": median(before.peak_memory[rows]),
        "memory_kind": before.memory_kind,
        "skipped": int(np.nansum(before.skipped[rows])),
        "nan": int(np.nansum(before.nan[rows])),
    }


def baseline_path(facts: CheckpointFacts) -> Path:
    return facts.directory.parent / layout.HISTORY / BASELINE


def store_baseline(facts: CheckpointFacts, baseline: dict) -> str | None:
    """Keep the baseline with the job; returns why it was not kept, if it was not."""
    if baseline["throughput_median"] is None and baseline["peak_memory_median"] is None:
        return "the records before the failure hold no steady state: the stored baseline is kept"
    path = baseline_path(facts)
    try:
        folder = own_folder(path.parent.parent, path.parent.name)
        atomic_write(folder / path.name, (json.dumps(baseline, indent=2) + "\n").encode())
    except OSError as e:
        return f"{path}: baseline not stored ({e.strerror})"
    return None


def stored_baseline(facts: CheckpointFacts) -> dict | None:
    baseline = read_json_state(baseline_path(facts), "the stored baseline")
    if baseline is not None and not isinstance(baseline, dict):
        raise Malformed(f"{baseline_path(facts)}: the stored baseline is not a JSON object")
    return baseline
