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
from tasks.checkpoint.signing import Trust
from tasks.cluster import process
from tasks.job.step_records import load_steps
from tasks.profile import load_profile
from tasks.recovery.data import skip_not_printed
from tasks.recovery.ledger import incidents
from tasks.recovery.report import plan_markdown
from tasks.recovery.run import Decision, Source
from tasks.recovery.run import recover as run_recovery
from tasks.recovery.triage import triage
from tasks.relaunch.printed import PrintedArgs
from tasks.resume.validate import validate_resume
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


def test_a_reproducible_nan_is_the_data_and_is_relaunched_past_its_iteration_once(
    nan_data, tmp_path, monkeypatch
):
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

    # recovery.skip_bad_data: never: a person decides, nothing is relaunched.
    never = job_copy(nan_data, tmp_path / "never", extra=RERUN, skip_bad_data="never")
    out, _ = recover(never, log=relaunch_log).communicate(timeout=600)
    stopped = json.loads(out)
    assert stopped["outcome"] == "stopped" and stopped["relaunched_job"] is None
    assert stopped["reason"].startswith("a data failure at iteration 6 (recovery.skip_bad_data: never)")

    # The person reads the skip on the form and approves; the relaunch inherits the environment.
    for name, value in elsewhere.items():
        monkeypatch.setenv(name, value)
    forms = []

    def approve(plan) -> Decision:
        forms.append(plan_markdown(plan))
        return Decision(True, "a person who read the skip")

    skip = run_recovery(load_profile(job.profile), Source(logs=[relaunch_log]), "test", approve)
    try:
        assert skip.outcome == "completed", skip.reason
        assert skip.cls == "data" and skip.checkpoint == 4
        assert skip.skipped == {"iterations": [6], "samples": [40, 48], "tokens": 8 * 32, "confirmed": True}
        (form,) = forms
        assert "- **skip**: iterations 6 (samples 40-47, 256 tokens) are passed untrained" in form
        assert "--ckpt-step 4 --iterations-to-skip 6" in form
        assert any(r["name"] == "data-after-skip" and not r["fired"] for r in skip.rules)
        log = Path(skip.relaunch_log).read_text()
        assert "iterations_to_skip .............................. [6]" in log
        assert "iteration        6/" not in log and "skipped samples:            8 |" in log
        # Every check passed, the skipped data's among them (an unchecked one would be named).
        assert skip.validation.startswith("VALIDATED resume from iteration 4"), skip.validation
        assert "skipped data" not in skip.validation and skip.recomputed_iterations == 1
        # The relaunch's own log against other windows: none (it passed data no recovery asked
        # it to: said) and the wrong one (iteration 7 was trained: rejected).
        outcomes = _checks(job, Path(skip.relaunch_log))
        assert outcomes([6])["skipped data"] == outcomes([6])["learning rate"] == "pass"
        assert outcomes(())["skipped data"] == "warn"
        assert outcomes([7])["skipped data"] == "fail"
        assert [(i.cls, i.outcome) for i in incidents(job.save)] == [
            ("numerics", "stopped"),
            ("data", "completed"),
        ]
    finally:
        stop_job(skip.relaunched_job)


def _checks(job: Job, log: Path):
    """Each check's outcome when the relaunch's log is validated with ``window`` skipped."""
    profile = load_profile(job.profile)
    after, checkpoint, trust = load_steps(log), job.save / "iter_0000004", Trust.of(profile)

    def outcomes(window) -> dict[str, str]:
        result = validate_resume(checkpoint, None, after, profile.resume, trust=trust, skip=window)
        return {c.name: str(c.outcome) for c in result.checks}

    return outcomes


def test_a_relaunch_megatron_lm_was_not_told_to_skip_is_named_before_it_trains(tmp_path):
    """What Megatron-LM printed decides whether the relaunch skips the window: an empty list (the
    script dropped CKPT_ITERATIONS_TO_SKIP), another iteration, or a version without the flag."""
    window = {"iterations": [6], "samples": [40, 48], "tokens": 256, "confirmed": False}

    def printed(value: str | None) -> PrintedArgs:
        return PrintedArgs({} if value is None else {"iterations_to_skip": value}, tmp_path / "out", 12)

    assert skip_not_printed(printed("[6]"), window) is None
    assert skip_not_printed(printed("[5, 6]"), window) is None
    assert skip_not_printed(printed("[]"), window).startswith(
        f"Megatron-LM was not told to skip iterations [6] (iterations_to_skip [] at {tmp_path}/out:12)"
    )
    assert "not told to skip iterations [6]" in skip_not_printed(printed("[7]"), window)
    assert "printed no iterations_to_skip" in skip_not_printed(printed(None), window)


def test_a_relaunch_from_before_an_earlier_skip_passes_it_again(tmp_path):
    """Skipped at 6 (confirmed) and at 14 (planned, never told to Megatron-LM): a relaunch from 4,
    whatever failed, must pass 6 again; one from 8 need not; 14 was never skipped."""
    from tasks.recovery.data import carried_skips
    from tasks.recovery.ledger import Incident

    six = Incident("a", "job", "event", relaunched_job="local:1")
    six.skipped = {"iterations": [6], "samples": [40, 48], "tokens": 256, "confirmed": True}
    fourteen = Incident("b", "job", "event", relaunched_job="local:2")
    fourteen.skipped = {"iterations": [14], "samples": [104, 112], "tokens": 256, "confirmed": False}
    assert carried_skips([six, fourteen], 4) == [6]
    assert carried_skips([six, fourteen], 8) == []


def test_a_checkpoint_saved_after_a_skip_still_tells_what_its_scheduler_counts():
    """Megatron-LM's scheduler does not step for a skipped iteration: at iteration 12 after one
    skipped batch of 8, it has counted 88 samples of the 96 consumed."""
    from tasks.checkpoint.facts import CheckpointFacts

    facts = CheckpointFacts(Path("iter_0000012"), 12, 96, 8, {"num_steps": 88}, 0.0, True, skipped_samples=8)
    assert facts.scheduler_unit == "samples"
    by_iteration = CheckpointFacts(
        Path("iter_0000012"), 12, 96, 8, {"num_steps": 11}, 0.0, True, skipped_samples=8
    )
    assert by_iteration.scheduler_unit == "iterations"
    assert (
        CheckpointFacts(Path("iter_0000012"), 12, 96, 8, {"num_steps": 88}, 0.0, True).scheduler_unit is None
    )
