"""A NaN that is the data, end to end in Megatron-LM's own loop with its rerun state machine
(``--rerun-mode validate_results``): iteration 6 of rank 1's data gives a NaN on every attempt.

1. The job: the NaN, a rerun on the same GPU reproduces it; the machine saves checkpoint 5 to
   rerun the iteration on another GPU and exits 16.
2. ``ckptops recover`` (numerics, exit 16) relaunches from 5; the relaunch lands on other GPUs
   (the CPU stand-in's devices: what excluding the node does on a cluster), where the second
   rerun reproduces the NaN: Megatron calls the result correct, i.e. the data; exit 17.
3. ``ckptops recover`` of that: class ``data`` at iteration 6; the relaunch goes from 4 (5 is
   the rerun machine's checkpoint: a load of it reruns 6 and exits), with --iterations-to-skip 6
   as Megatron-LM printed it, trains past 6, and validates: iteration 5 recomputed bit-exact, 6
   never trained, exactly one batch skipped, the schedule one step behind the iteration count.
"""

import json
import os
from pathlib import Path

import pytest

from infra.local_job.cpu_loop import DEVICE_BASE_ENV
from tasks.cluster import process
from tasks.recovery.ledger import incidents
from tasks.recovery.triage import triage
from tests.test_recovery_safety import Job, _script, job_copy, recover, stop_job

FAULT = "1:6:nan-data"
RERUN = ("--rerun-mode", "validate_results")


@pytest.fixture(scope="module")
def nan_data(tmp_path_factory) -> Job:
    """The job run to its first exit: the NaN reproduced on the same GPU (exit 16)."""
    root = tmp_path_factory.mktemp("nan-data")
    save, records = root / "checkpoints", root / "records.jsonl"
    extra = (*RERUN, "--result-rejected-tracker-filename", str(root / "rejected.txt"))
    script, log = _script(root, save, records, extra), root / "train.out"
    job = process.start(["bash", str(script)], log, {**os.environ, "CKPTOPS_FAIL_AT": FAULT})
    with pytest.raises(process.Failed):
        process.wait(job, log, 600, "the job whose data is bad at iteration 6")
    return Job(root, save, records, script, log, Path())


def test_a_reproducible_nan_is_the_data_and_is_relaunched_past_its_iteration_once(nan_data, tmp_path):
    first = triage([nan_data.log])
    assert (first.cls, first.exit_code, first.anomaly_iteration) == ("numerics", 16, 6), first.line()
    job = job_copy(nan_data, tmp_path, extra=RERUN, progress_steps=4)
    elsewhere = {"CKPTOPS_FAIL_AT": FAULT, DEVICE_BASE_ENV: "2"}

    run = recover(job, env=elsewhere)
    out, err = run.communicate(timeout=600)
    rerun = json.loads(out)
    stop_job(rerun["relaunched_job"])
    assert rerun["checkpoint"] == 5 and rerun["outcome"] == "stopped", err[-3000:]
    relaunch_log = Path(rerun["relaunch_log"])
    second = triage([relaunch_log])
    assert (second.cls, second.exit_code, second.anomaly_iteration) == ("data", 17, 6), second.line()

    run = recover(job, env=elsewhere, log=relaunch_log)
    out, err = run.communicate(timeout=600)
    skip = json.loads(out)
    try:
        assert run.returncode == 0 and skip["outcome"] == "completed", (skip["reason"], err[-3000:])
        assert skip["class"] == "data" and skip["checkpoint"] == 4
        assert skip["skipped"] == {"iterations": [6], "samples": [40, 48], "tokens": 8 * 32}
        assert any(r["name"] == "data-after-skip" and not r["fired"] for r in skip["rules"])
        log = Path(skip["relaunch_log"]).read_text()
        assert "iterations_to_skip .............................. [6]" in log
        assert "iteration        6/" not in log and "skipped samples:            8 |" in log
        # Every check passed, the skipped data's among them (an unchecked one would be named).
        assert skip["validation"].startswith("VALIDATED resume from iteration 4"), skip["validation"]
        assert "skipped data" not in skip["validation"] and skip["recomputed_iterations"] == 1
        assert [(i.cls, i.outcome) for i in incidents(job.save)] == [
            ("numerics", "stopped"),
            ("data", "completed"),
        ]
    finally:
        stop_job(skip["relaunched_job"])
