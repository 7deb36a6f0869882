"""The continuation drill (tasks/restore/continuation.py): after restore, verify and load, the
job's own batch script trains on from the restored copy, and its log is compared with the
original run's for the same iterations. On Megatron-LM's own loop, with the local job's script."""

import shutil

import pytest

from infra.local_job.launch import write_job_script
from tasks.checkpoint.catalog import catalog
from tasks.checkpoint.promote import promote
from tasks.errors import UsageError
from tasks.profile import load_profile
from tasks.restore.drill import run_drill
from tasks.restore.history import read_drills
from tests.conftest import iter_dir, verify_and_record_here, write_job_profile
from tests.test_cli import ckptops_here


def continuation_profile(trained, tmp_path, options, iteration: int, extra=()):
    """A copy of the trained job with ``iteration`` promoted, its batch script (the trained run's
    arguments, and ``extra``) and its original log as the reference."""
    save = shutil.copytree(trained, tmp_path / "checkpoints")
    promote(save, options, 30, requested=iteration)
    script = write_job_script(
        tmp_path / "job.sh",
        save,
        tmp_path / "records.jsonl",
        train_iters=24,
        save_interval=4,
        extra=["--verify-integrity", *extra],
    )
    reference = trained.parent / f"{trained.name}-train.log"
    continuation = f", continuation: {{script: '{script}', reference: '{reference}'}}"
    return load_profile(write_job_profile(tmp_path, save, drill_extra=continuation)), save


def by_name(report) -> dict:
    return {c.name: c for c in report.checks}


def test_a_correct_checkpoint_continues_bit_exact_as_the_original_run(trained, tmp_path, options):
    profile, save = continuation_profile(trained, tmp_path, options, 16)
    before = {str(p): p.stat().st_mtime_ns for p in save.glob("iter_*/*")}
    report = run_drill(profile, "shared", continue_steps=4)
    assert report.ok, report.reason
    assert report.reason.endswith("and trained on 4 iterations as the original run did")
    found = by_name(report)
    assert found["continuation"].detail == (
        "iterations 17-20 trained from the restored copy match the original run's log (exact)"
    )
    loss = found["loss and grad norm"]
    assert (
        loss.outcome.value == "pass"
        and loss.expected.startswith("4 recomputed")
        and "bit-exact" in loss.expected
    )
    assert found["resume point"].outcome.value == "pass" and found["learning rate"].outcome.value == "pass"
    assert report.continuation_seconds > 0 and "continue" not in [p.name for p in report.phases]
    # Nothing saved into the job's directory (Megatron saves at --exit-interval when it has --save),
    # but for ckptops' record in the checkpoint's manifest: certified.
    now = {str(p): p.stat().st_mtime_ns for p in save.glob("iter_*/*")}
    assert {p for p in now if now[p] != before.get(p)} == {str(save / "iter_0000016" / "manifest.json")}
    assert report.certified
    (info,) = [i for i in catalog(save, options) if i.iteration == 16]
    assert info.certified and info.certification.startswith("iterations 17-20 trained from the restored copy")
    shown = ckptops_here("status", save)
    assert "valid, certified" in shown.stdout
    # Verified again, the same save stays certified; the next continuation is recorded over it.
    assert verify_and_record_here(iter_dir(save, 16), options).manifest.certified


def test_a_continuation_on_another_data_order_fails_naming_the_check_and_iteration(
    trained, tmp_path, options
):
    profile, save = continuation_profile(trained, tmp_path, options, 16, extra=["--seed", "99"])
    report = run_drill(profile, "shared", continue_steps=4)
    assert not report.ok
    assert report.reason == "continuation: iterations 17-20 differ from the original run (loss and grad norm)"
    loss = by_name(report)["loss and grad norm"]
    assert loss.outcome.value == "fail" and "at iteration 17" in loss.expected
    # Valid still, and flagged: it loads but does not resume.
    (info,) = [i for i in catalog(save, options) if i.iteration == 16]
    assert info.state.value == "valid" and info.certified is False
    assert info.certification.startswith("loads, does not resume: iterations 17-20 differ")


def test_a_checkpoint_whose_next_iterations_are_not_logged_yet_is_not_checkable_not_failed(
    trained, tmp_path, options
):
    profile, _ = continuation_profile(trained, tmp_path, options, 24)
    report = run_drill(profile, "shared", continue_steps=4)
    assert report.ok, report.reason
    found = by_name(report)["continuation"]
    assert (found.outcome.value, found.detail) == (
        "unchecked",
        "not checkable yet: the original run has logged up to iteration 24, the 4 after 24 are needed",
    )


def test_a_script_that_does_not_read_ckpt_load_is_refused_before_anything_is_restored(
    trained, tmp_path, options
):
    profile, save = continuation_profile(trained, tmp_path, options, 16)
    script = profile.drill.continuation.script
    script.write_text(script.read_text().replace("CKPT_LOAD", "CKPT_ELSEWHERE"))
    with pytest.raises(
        UsageError, match=f"^{script}: does not read CKPT_LOAD: it would train from, and save into"
    ):
        run_drill(profile, "shared", continue_steps=4)
    assert read_drills(save) == [] and not profile.drill.scratch_dir.exists()
