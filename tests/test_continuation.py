"""The continuation drill (tasks/restore/continuation.py): after restore, verify and load, the
job's own batch script trains on from the restored copy, and its log is compared with the
original run's for the same iterations. On Megatron-LM's own loop, with the local job's script."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from prefect.artifacts import Artifact

from infra.local_job.launch import write_job_script
from tasks.checkpoint.catalog import catalog
from tasks.checkpoint.facts import checkpoint_facts
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.promote import promote
from tasks.cluster import process
from tasks.errors import CkptopsError, UsageError
from tasks.job.step_records import load_steps
from tasks.profile import load_profile
from tasks.relaunch.continuity import Continuity
from tasks.restore.continuation import TOLERANCES
from tasks.restore.drill import run_drill
from tasks.restore.history import read_drills, trend_rows
from tests.conftest import CORRUPTED, free_port, iter_dir, verify_and_record_here, write_job_profile
from tests.test_cli import ckptops_here
from tests.test_slurm import ON_TWO_NODES


def continuation_profile(
    trained,
    tmp_path,
    options,
    iteration: int,
    extra=(),
    train_iters=24,
    save_interval=4,
    drill_extra="",
    name="checkpoints",
):
    """A copy of the trained job (in ``name``), verified, with ``iteration`` promoted, its batch script (the
    trained run's arguments, and ``extra``) and its original log as the reference."""
    save = shutil.copytree(trained, tmp_path / name)
    for directory in sorted(save.glob("iter_*")):  # each verified as it was saved
        verify_and_record_here(directory, options)
    promote(save, options, 30, requested=iteration)
    script = write_job_script(
        tmp_path / "job.sh",
        save,
        tmp_path / "records.jsonl",
        port=free_port(),
        train_iters=train_iters,
        save_interval=save_interval,
        extra=list(extra),
    )
    reference = trained.parent / f"{trained.name}-train.log"
    continuation = f", continuation: {{script: '{script}', reference: '{reference}'}}{drill_extra}"
    return load_profile(write_job_profile(tmp_path, save, drill_extra=continuation)), save


# The trained fixture's own switch (Megatron-LM's integrity.json beside each save).
INTEGRITY = ("--verify-integrity",)


def by_name(report) -> dict:
    return {c.name: c for c in report.checks}


def test_a_correct_checkpoint_continues_bit_exact_as_the_original_run(trained, tmp_path, options):
    # The newest (24) is promoted; the original run has logged up to 24, so the newest checkpoint
    # whose next 4 iterations it has logged is 20: that one is drilled.
    profile, save = continuation_profile(trained, tmp_path, options, 24, INTEGRITY)
    before = {str(p): p.stat().st_mtime_ns for p in save.glob("iter_*/*")}
    report = run_drill(profile, "shared", continue_steps=4)
    assert report.ok, report.reason
    assert report.reason.endswith("and trained on 4 iterations as the original run did")
    found = by_name(report)
    assert found["continuation"].detail == (
        "iterations 21-24 trained from the restored copy match the original run's log (exact); "
        "iteration 20, the newest whose next 4 iterations the original run has logged (24 is newer)"
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
    assert {p for p in now if now[p] != before.get(p)} == {str(save / "iter_0000020" / "manifest.json")}
    assert report.certified
    (info,) = [i for i in catalog(save, options) if i.iteration == 20]
    assert info.certified and info.certification.startswith("iterations 21-24 trained from the restored copy")
    record = read_manifest(iter_dir(save, 20)).certification
    assert (record["drill"], record["steps"], record["tolerance"]) == (report.id, 4, "exact")
    assert record["largest_difference"] == 0.0
    assert report.line().endswith("; the checkpoint is certified")
    assert trend_rows(read_drills(save))[-1]["continued"] == "certified"
    shown = ckptops_here("status", save)
    assert "valid, certified" in shown.stdout
    # Verified again, the same save stays certified; the next continuation is recorded over it.
    assert verify_and_record_here(iter_dir(save, 20), options).manifest.certified


def test_a_continuation_that_trains_otherwise_fails_naming_the_check_and_iteration(
    trained, tmp_path, options
):
    # Dropout: a flag the relaunch comparison does not weigh, which changes every loss from 17 on.
    profile, save = continuation_profile(
        trained, tmp_path, options, 16, extra=[*INTEGRITY, "--hidden-dropout", "0.1"]
    )
    report = run_drill(profile, "shared", continue_steps=4)
    assert not report.ok
    assert report.reason == "continuation: iterations 17-20 differ from the original run (loss and grad norm)"
    loss = by_name(report)["loss and grad norm"]
    assert loss.outcome.value == "fail" and "at iteration 17" in loss.expected
    # Valid still, and flagged: it loads but does not resume.
    (info,) = [i for i in catalog(save, options) if i.iteration == 16]
    assert info.state.value == "valid" and info.certified is False
    assert info.certification.startswith("loads, does not resume: iterations 17-20 differ")


def test_a_script_on_another_data_order_is_not_run_and_the_checkpoint_is_not_blamed(
    trained, tmp_path, options
):
    profile, save = continuation_profile(trained, tmp_path, options, 16, extra=[*INTEGRITY, "--seed", "99"])
    report = run_drill(profile, "shared", continue_steps=4)
    assert not report.ok and report.continuation_log is None
    assert by_name(report)["continuation"].detail == "not run"
    assert report.reason.startswith("relaunch arguments: ") and report.reason.endswith(
        "does not fit checkpoint 16: data: --seed is 99, the checkpoint was saved with 1234: the data order, "
        "or what a sample is, changes from here on"
    )
    (info,) = [i for i in catalog(save, options) if i.iteration == 16]
    assert info.state.value == "valid" and info.certified is None


def test_a_checkpoint_whose_scheduler_was_changed_loads_verifies_and_fails_on_the_learning_rate(
    corrupted, prefect_api, tmp_path, options
):
    from flows.restore_drill import restore_drill

    assert CORRUPTED[16] == "lr-schedule"
    keep = ["--use-checkpoint-opt_param-scheduler"]  # the job loads the scheduler's saved values
    profile, save = continuation_profile(
        corrupted, tmp_path, options, 16, keep, train_iters=20, save_interval=2
    )
    state = restore_drill(profile=str(profile.source), source="shared", continue_steps=2, return_state=True)
    assert state.is_failed()
    assert state.message.endswith(
        ": continuation: iterations 17-18 differ from the original run (learning rate)"
    )
    (drill,) = read_drills(save)
    found = {c["name"]: c for c in drill["checks"]}
    assert [found[name]["outcome"] for name in ("tensors", "scheduler")] == ["pass", "pass"]
    lr = found["learning rate"]
    assert lr["outcome"] == "fail" and "at iteration 17" in lr["expected"], lr
    assert float(lr["observed"]) < float(lr["expected"].split()[0])  # a shorter decay: a lower rate
    (info,) = [i for i in catalog(save, options) if i.iteration == 16]
    assert info.state.value == "valid" and info.certified is False
    # The UI: both runs' loss and learning rate, drawn and tabled; the trend says it.
    drawn = drill["continuation_series"]
    assert drawn["iteration"] == [17, 18] and drawn["continued_lr"][0] < drawn["original_lr"][0]
    artifact = Artifact.get("drill-continuation-test-job").data
    assert "data:image/png;base64," in artifact
    assert f"| 17 | {drawn['original_loss'][0]!r} | {drawn['continued_loss'][0]!r} |" in artifact
    (row,) = json.loads(Artifact.get("drill-history-test-job").data)
    assert row["continued"] == "does not resume"


def test_a_continuation_runs_under_slurm_on_the_jobs_own_allocation(slurm_conf, trained, tmp_path, options):
    profile, save = continuation_profile(trained, tmp_path, options, 16, INTEGRITY, drill_extra=ON_TWO_NODES)
    report = run_drill(profile, "shared", continue_steps=2)
    assert report.ok, report.reason
    assert by_name(report)["continuation"].detail.startswith(
        "iterations 17-18 trained from the restored copy"
    )
    log = Path(report.continuation_log).read_text()
    assert "0: " in log and "1: " in log  # srun's labels: one rank on each of the two nodes
    assert report.certified


def test_a_checkpoint_whose_next_iterations_are_not_logged_yet_is_not_checkable_not_failed(
    trained, tmp_path, options
):
    profile, _ = continuation_profile(trained, tmp_path, options, 24, INTEGRITY)
    report = run_drill(profile, "shared", continue_steps=30)  # more than the run has trained
    assert report.ok, report.reason
    found = by_name(report)["continuation"]
    assert (found.outcome.value, found.detail) == (
        "unchecked",
        "not checkable yet: the original run has logged up to iteration 24, the 30 after 24 are needed",
    )


def test_a_script_that_does_not_read_ckpt_load_is_refused_before_anything_is_restored(
    trained, tmp_path, options
):
    profile, save = continuation_profile(trained, tmp_path, options, 16, INTEGRITY)
    script = profile.drill.continuation.script
    script.write_text(script.read_text().replace("CKPT_LOAD", "CKPT_ELSEWHERE"))
    with pytest.raises(
        UsageError, match=f"^{script}: does not read CKPT_LOAD: it would train from, and save into"
    ):
        run_drill(profile, "shared", continue_steps=4)
    assert read_drills(save) == [] and not profile.drill.scratch_dir.exists()


def _hostile_scripts(base: str, save: Path, reference: Path, daemon: Path) -> dict[str, tuple[str, int]]:
    """The local job's own script, changed as an unlucky or hostile team would (probe 3 of issue
    34), each with the continuation's steps."""
    repo = re.search(r"^cd (.+)$", base, re.M)[1]
    ours = 'save=(--save "$CKPT_SAVE")'
    relative = (
        base.replace(f"cd {repo}", f"cd '{save.parent}'\nsetsid sleep 300 & echo $! > '{daemon}'")
        .replace("infra/local_job/pretrain.py", f"{repo}/infra/local_job/pretrain.py")
        .replace(ours, f'save=(--save "{save.name}")')
    )
    labelled = base.replace(ours, f"save=(--save '{save}')").replace(
        'exec >"$CKPT_LOG" 2>&1', 'exec > >(sed -u "s/^/0: /" >"$CKPT_LOG") 2>&1'
    )
    shard = 'rm -f "$(ls "$CKPT_LOAD"/iter_*/*.distcp | head -n 1)"\nexit $status'
    deleting = base.replace("exit $status", shard)
    dots = "." * 44  # Megatron-LM pads "save" and "load" to 48
    fake = (
        "#!/bin/bash\n# the original run's log, as if it had trained now from $CKPT_LOAD\n"
        f'sed -e "s#^  save \\.* .*#  save {dots} $CKPT_SAVE#" '
        f'-e "s#^  load \\.* .*#  load {dots} $CKPT_LOAD#" -e "/] iteration *\\([0-9]\\|1[0-9]\\|20\\)\\//d" '
        '-e "/end of arguments/a\\  successfully loaded checkpoint from $CKPT_LOAD [ t 1/1, gtp_remat 1/1, '
        f'p 1/1 ] at iteration $CKPT_STEP" \'{reference}\' > "$CKPT_LOG"\n'
    )
    # The same, its iteration lines stamped now: only the save Megatron-LM makes when it exits
    # at --exit-interval is missing.
    now = "$(date '+%Y-%m-%d %H:%M:%S.%6N')"
    stamped = f'-e "s#^ \\[[-0-9]* [0-9:.]*\\]# [{now}]#" '
    fresh = fake.replace('-e "/end of arguments/a', stamped + '-e "/end of arguments/a')
    return {
        "cd and a relative --save": (relative, 4),
        "srun labels, a space in the save directory, --continue 2": (labelled, 2),
        "a shard of the copy deleted": (deleting, 4),
        "a fake log": (fake, 4),
        "a fake log stamped now": (fresh, 4),
    }


def test_a_continuation_cannot_touch_production_or_certify_without_training_from_the_copy(
    trained, tmp_path, options
):
    profile, save = continuation_profile(trained, tmp_path, options, 24, INTEGRITY, name="check points")
    script = profile.drill.continuation.script
    daemon = tmp_path / "daemon.pid"
    hostile = _hostile_scripts(script.read_text(), save, profile.drill.continuation.reference, daemon)

    def production() -> dict:  # the checkpoints, the tracker and the pointer (not ckptops' records)
        kept = (p for p in save.rglob("*") if not p.relative_to(save).parts[0].startswith(".ckptops"))
        return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns, p.lstat().st_ino) for p in kept}

    untouched = production()
    reasons, logs = {}, {}
    for case, (text, steps) in hostile.items():
        script.write_text(text)
        report = run_drill(profile, "shared", continue_steps=steps)
        assert not report.ok and not report.certified, (case, report.reason)
        assert production() == untouched, case
        assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "24", case
        reasons[case], logs[case] = report.reason, report.continuation_log
    (relative, labelled, deleted, fake, fresh) = reasons.values()
    for stopped in list(hostile)[:2]:  # stopped before Megatron-LM's first iteration line
        assert not re.search(r"\] iteration +\d+/", Path(logs[stopped]).read_text()), stopped
    assert relative.startswith(f"printed arguments: save is check points ({save}), not CKPT_SAVE ")
    assert relative.endswith("; stopped before its first iteration")
    assert labelled.startswith(f"printed arguments: save is {save}, not CKPT_SAVE ")
    assert labelled.endswith("; stopped before its first iteration")
    assert deleted.startswith("restored copy: after the continuation: ") and "failed verification" in deleted
    assert re.fullmatch(
        r"continuation evidence: .*\.continuation\.log: iteration 21 is not stamped after the drill began: "
        "not certified",
        fake,
    )
    assert fresh.startswith("continuation evidence: ") and (
        "but saved no checkpoint of iteration 24 there, as Megatron-LM does when it exits" in fresh
    ), fresh
    # What the first script started in a session of its own ended with it.
    assert not process.running(int(daemon.read_text()))
    assert read_manifest(iter_dir(save, 20)).certification is None  # nothing recorded either way


def _perturbed(log: Path, target: Path, changes: dict[int, float]) -> Path:
    """The run's log with the loss of each iteration in ``changes`` scaled by its factor."""
    lines = []
    for line in log.read_text().splitlines():
        found = re.search(r"iteration\s+(\d+)/.*lm loss: (\S+) \|", line)
        if found and int(found[1]) in changes:
            value = float(found[2]) * changes[int(found[1])]
            line = line.replace(f"lm loss: {found[2]} |", f"lm loss: {value:.6E} |")
        lines.append(line)
    target.write_text("\n".join(lines) + "\n")
    return target


@pytest.mark.parametrize(
    ("changes", "failing"),
    [
        ({18: 1 + 1e-3, 19: 1 + 1e-3}, None),  # bf16: later steps within 5e-3 ...
        ({17: 1 + 1e-5}, 17),  # ... the first step within 1e-6
        ({18: 1 + 1e-2}, 18),
    ],
)
def test_the_bf16_envelope_holds_the_first_step_to_1e_6_and_later_steps_to_5e_3(
    trained, tmp_path, changes, failing
):
    reference = trained.parent / f"{trained.name}-train.log"
    before, after = load_steps(reference), load_steps(_perturbed(reference, tmp_path / "after.log", changes))
    first, later = TOLERANCES["bf16"]
    settings = load_profile().resume.model_copy(
        update={"loss_rel_tolerance": later, "first_rel_tolerance": first}
    )
    facts = checkpoint_facts(iter_dir(trained, 16))
    validation = Continuity(facts, before, after, settings).continuation()
    loss = by_name(validation)["loss and grad norm"]
    largest = max(changes.values()) - 1
    assert validation.largest_difference == pytest.approx(largest, rel=0.05)  # to the printed digits
    if failing is None:
        assert loss.outcome.value == "pass" and "within 1e-06 at the first, 0.005 after" in loss.expected
    else:
        assert loss.outcome.value == "fail" and f"at iteration {failing}" in loss.expected
        assert "1e-06 at the first, 0.005 after" in loss.detail


def _production(save: Path) -> Path:
    """A save directory as a live job leaves it: checkpoints 16, 20 and 24, Megatron-LM's tracker
    at 24, ckptops' pointer at 20, ckptops's own records beside them."""
    for iteration in (16, 20, 24):
        folder = save / f"iter_{iteration:07d}"
        folder.mkdir(parents=True)
        for name in ("__0_0.distcp", ".metadata", "metadata.json"):
            (folder / name).write_bytes(b"x" * iteration)
    (save / "latest_checkpointed_iteration.txt").write_text("24")
    (save / "latest_verified_iteration.txt").write_text("20")
    (save / ".ckptops-history").mkdir()
    return save


def _saved_by_the_job(save: Path, iteration: int) -> None:
    folder = save / f"iter_{iteration:07d}"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"new")
    (save / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def test_the_fingerprint_takes_any_change_of_what_a_resume_reads_as_the_continuations(tmp_path):
    """ckptops's own records, the job's TensorBoard files beside its checkpoints: no change. A
    new iteration, even one past where the job was (the continuation's save cannot be told from
    the job's own while it runs), a promotion, a checkpoint's file rewritten or removed, a
    tracker moved: each is, and is named. Before: a save newer than every checkpoint at the start
    was taken for the job's own, with the tracker and pointer moving on to it."""
    from tasks.restore.continuation import changes, fingerprint

    def after(change) -> str | None:
        save = _production(tmp_path / f"save-{len(list(tmp_path.iterdir()))}")
        before = fingerprint(save, set())
        change(save)
        return changes(before, fingerprint(save, set()))

    def records_only(save: Path) -> None:
        (save / ".ckptops.lock").write_text('{"pid": 1}')  # the verify-and-promote run's lock
        (save / ".ckptops-history" / "promotions.jsonl").write_text("{}\n")
        (save / "tb").mkdir()  # --tensorboard-dir under the save directory

    def saves_past_the_newest(save: Path) -> None:
        _saved_by_the_job(save, 28)

    def promotes_and_retires(save: Path) -> None:
        _saved_by_the_job(save, 28)
        (save / "latest_verified_iteration.txt").write_text("28")
        shutil.rmtree(save / "iter_0000016")  # retention keeps the newest three

    def promotes_an_older_one(save: Path) -> None:
        (save / "latest_verified_iteration.txt").write_text("24")

    def continues_into_production(save: Path) -> None:
        _saved_by_the_job(save, 22)

    def rewrites_the_promoted_one(save: Path) -> None:
        (save / "iter_0000020" / "__0_0.distcp").write_bytes(b"the continuation's own state")

    def removes_one(save: Path) -> None:
        shutil.rmtree(save / "iter_0000016")

    assert after(records_only) is None
    assert after(saves_past_the_newest) == (
        "iter_0000028 appeared, a new iteration in production while the continuation ran; "
        "latest_checkpointed_iteration.txt went from 24 to 28"
    )
    assert after(promotes_and_retires).startswith(
        "iter_0000016 was removed; iter_0000016/.metadata was removed"
    )
    assert after(promotes_an_older_one) == "latest_verified_iteration.txt went from 20 to 24"
    assert after(continues_into_production) == (
        "iter_0000022 appeared, a new iteration in production while the continuation ran; "
        "latest_checkpointed_iteration.txt went from 24 to 22"
    )
    assert after(rewrites_the_promoted_one).startswith("iter_0000020/__0_0.distcp changed (size")
    assert after(removes_one).startswith("iter_0000016 was removed; iter_0000016/.metadata was removed")


def test_a_fifo_as_the_continuation_script_is_refused_in_one_line(tmp_path):
    """Before: reading it blocked the drill for good (no writer ever comes)."""
    from types import SimpleNamespace

    from tasks.relaunch.script import script_args
    from tasks.restore.continuation import continuation_sources

    fifo = tmp_path / "job.sh"
    os.mkfifo(fifo)
    settings = SimpleNamespace(script=fifo, reference=tmp_path / "train.log")
    profile = SimpleNamespace(source="p.yaml", drill=SimpleNamespace(continuation=settings), recovery=None)
    with pytest.raises(UsageError, match=f"^the job's batch script: {fifo}: a FIFO, not a regular file"):
        continuation_sources(profile)
    with pytest.raises(CkptopsError, match=f"^{fifo}: a FIFO, not a regular file"):
        script_args(fifo, {})
