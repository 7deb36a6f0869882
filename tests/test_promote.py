"""Promotion: the pointer is atomic under crashes, exclusive under concurrency, and only ever
names a checkpoint proven valid."""

import os
import select
import subprocess
import sys
import time

import pytest

from tasks.checkpoint.layout import POINTER, iter_dir_name
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.pointer import pointer_during, read_hold, read_pointer, write_pointer
from tasks.checkpoint.promote import PromotionReport, Waiting, promote
from tasks.checkpoint.retention import RetentionPlan
from tasks.checkpoint.state import Completeness, State, VerifyOptions
from tasks.checkpoint.verify import Verification
from tasks.errors import CkptopsError, UsageError
from tests.conftest import ROOT, flip_byte, iter_dir, verify_and_record_here
from tests.test_verify import tensor_data_offset

CHILD = ROOT / "tests" / "helpers" / "promote_child.py"
STEPS = ["_write_temp", "_fsync_file", "_replace", "_fsync_dir"]


def child(*args, **kwargs):
    return subprocess.run(
        [sys.executable, str(CHILD), *map(str, args)],
        cwd=ROOT,
        timeout=120,
        capture_output=True,
        text=True,
        **kwargs,
    )


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", STEPS)
def test_kill_at_each_step_leaves_old_or_new_pointer(tmp_path, step, when):
    write_pointer(tmp_path, 8)
    result = child("crash", tmp_path, 12, step, when)
    assert result.returncode == -9, result.stderr
    value = read_pointer(tmp_path)
    # Up to the rename the old value stands; from the rename on, the new one.
    renamed = STEPS.index(step) > STEPS.index("_replace") or (step == "_replace" and when == "after")
    assert value == (12 if renamed else 8)
    assert (tmp_path / POINTER).read_text() == f"{value}\n"
    write_pointer(tmp_path, 16)  # the next promotion clears whatever the crash left
    assert read_pointer(tmp_path) == 16
    assert sorted(p.name for p in tmp_path.iterdir()) == [POINTER]


def test_kill_during_a_whole_promotion_then_rerun(save_dir, options):
    """Killed after the first manifest's temp file, after its rename, and after the pointer's
    rename: each time the pointer is old or new, and the next run finishes the job."""
    for step, when, nth, pointer in [
        ("_write_temp", "after", 1, None),
        ("_replace", "after", 1, None),
        ("_replace", "after", 7, 24),
    ]:
        result = child("promote", save_dir, step, when, nth)
        assert result.returncode == -9, result.stderr
        assert read_pointer(save_dir) == pointer
        report = promote(save_dir, options, 10)
        assert report.current == 24 and read_pointer(save_dir) == 24
        assert not report.invalid
        for path in save_dir.glob("iter_*/manifest.json"):
            assert read_manifest(path.parent).valid
        (save_dir / POINTER).unlink()
        for path in save_dir.glob("iter_*/manifest.json*"):
            path.unlink()


def test_full_disk_in_the_middle_of_a_write_leaves_no_temp(tmp_path, monkeypatch):
    import errno

    from tasks.storage import local

    write_pointer(tmp_path, 8)
    real_write = os.write

    def half_then_enospc(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local.os, "write", half_then_enospc)
    with pytest.raises(OSError, match="No space left"):
        write_pointer(tmp_path, 123456)
    assert read_pointer(tmp_path) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == [POINTER]


def test_kill_halfway_through_the_write(tmp_path):
    write_pointer(tmp_path, 8)
    assert child("torn", tmp_path, 123456).returncode == -9
    assert read_pointer(tmp_path) == 8


@pytest.mark.parametrize("step", STEPS[:3])
def test_failure_at_each_step_keeps_old_pointer_and_no_temp(tmp_path, step):
    write_pointer(tmp_path, 8)
    result = child("fail", tmp_path, 12, step)
    assert result.returncode == 1 and "No space left on device" in result.stderr
    assert read_pointer(tmp_path) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == [POINTER]


@pytest.mark.parametrize("text", ["12\x00\x00", "+12\n", "1_2\n", "\uff11\uff12\n", "12 13\n", "-12\n", ""])
def test_garbled_pointer_is_reported_not_trusted(tmp_path, text):
    """Only what a writer of it writes, ASCII digits, is an iteration (int() takes more)."""
    (tmp_path / POINTER).write_text(text)
    with pytest.raises(CkptopsError, match=f"{POINTER}: garbled pointer"):
        read_pointer(tmp_path)


def _read_line(process, timeout=120.0) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, "child did not answer in time"
    return process.stdout.readline().strip()


def test_concurrent_promotions_do_not_interleave(save_dir, tmp_path):
    log = tmp_path / "sections.log"
    hold = lambda name, timeout: subprocess.Popen(  # noqa: E731
        [sys.executable, str(CHILD), "hold", str(save_dir), name, str(timeout), str(log)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    a = hold("A", 120)
    try:
        inside, holder = _read_line(a).split()
        assert inside == "inside"
        # While A holds the lock, a run that will not wait is refused, naming the holder.
        refused = child("hold", save_dir, "C", 0, log)
        assert refused.returncode == 3 and f"held by pid {holder}" in refused.stdout
        b = hold("B", 120)
        a.stdin.write("go\n")
        a.stdin.flush()
        assert a.wait(timeout=120) == 0
        assert _read_line(b).split()[0] == "inside"
        b.stdin.write("go\n")
        b.stdin.flush()
        assert b.wait(timeout=120) == 0
    finally:
        for p in (a,):
            p.kill()
    assert log.read_text().split() == ["A-enter", "A-exit", "B-enter", "B-exit"]
    assert read_pointer(save_dir) == 24


def test_promote_verifies_oldest_first_and_points_to_newest_valid(save_dir, options):
    seen = []
    report = promote(save_dir, options, 10, on_verified=lambda v: seen.append(v.iteration))
    assert seen == [4, 8, 12, 16, 20, 24]
    assert report.previous is None and report.current == 24 and report.changed
    assert read_pointer(save_dir) == 24


def test_newest_failed_checkpoint_is_not_promoted(save_dir, options):
    directory = iter_dir(save_dir, 24)
    flip_byte(directory / "__0_0.distcp", tensor_data_offset(directory, "__0_0.distcp"))
    report = promote(save_dir, options, 10)
    assert [v.iteration for v in report.invalid] == [24]
    assert report.current == 20 and read_pointer(save_dir) == 20


def test_in_progress_checkpoint_is_neither_failed_nor_promoted(save_dir, options):
    (iter_dir(save_dir, 24) / "metadata.json").unlink()
    report = promote(save_dir, options, 10)
    assert [v.iteration for v in report.in_progress] == [24] and not report.invalid
    assert read_pointer(save_dir) == 20
    assert not (iter_dir(save_dir, 24) / "manifest.json").exists()


def test_pointer_is_removed_when_nothing_valid_is_left(save_dir, options):
    """Never leave the pointer naming a failed checkpoint, even when there is nothing better."""
    promote(save_dir, options, 10)
    for iteration in (4, 8, 12, 16, 20, 24):
        directory = iter_dir(save_dir, iteration)
        flip_byte(directory / "__0_0.distcp", tensor_data_offset(directory, "__0_0.distcp"))
        assert verify_and_record_here(directory, options).state is State.INVALID
    report = promote(save_dir, options, 10)
    assert report.cleared and read_pointer(save_dir) is None
    assert report.message.startswith("no valid checkpoint left: iter_0000024 is now invalid")


def test_rollback_holds_until_checkpoints_verified_after_it(save_dir, options):
    promote(save_dir, options, 10)
    report = promote(save_dir, options, 10, requested=8)
    assert report.current == 8 and read_hold(save_dir).iteration == 8
    # The scheduled run must not undo the operator's rollback to the checkpoints it rejected.
    again = promote(save_dir, options, 10)
    assert again.current == 8 and again.message == "held at 8 by an operator's rollback"
    # Training resumed from 8 and saved iteration 12 again: re-saved, re-verified, promotable.
    directory = iter_dir(save_dir, 12)
    (directory / "metadata.json").write_bytes((directory / "metadata.json").read_bytes())
    resumed = promote(save_dir, options, 10)
    assert [v.iteration for v in resumed.verifications] == [12]
    assert resumed.current == 12 and read_hold(save_dir) is None


def test_the_promotion_log_says_what_the_pointer_was_at_any_moment(save_dir, options):
    """Post-resume validation asks which checkpoint was the one to resume from at the resume."""
    before_any = time.time()
    promote(save_dir, options, 10)
    after_first = time.time()
    promote(save_dir, options, 10, requested=8)
    now = time.time()
    assert pointer_during(save_dir, before_any - 1, before_any) == {None}  # nothing promoted yet
    assert pointer_during(save_dir, after_first, after_first) == {24}
    assert pointer_during(save_dir, now, now) == {8}
    assert pointer_during(save_dir, before_any, now) == {None, 24, 8}
    log = save_dir / ".ckptops-history" / "promotions.jsonl"
    log.write_text(log.read_text() + '{"time": 1e99, "iterat')  # torn: the next entry starts a new line
    promote(save_dir, options, 10, requested=24)
    assert pointer_during(save_dir, time.time(), time.time()) == {24}


def test_a_failed_log_write_costs_a_rollback_nothing_and_is_reconciled(save_dir, options, monkeypatch):
    import tasks.checkpoint.promote as promotion

    promote(save_dir, options, 10)
    logged = time.time()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(promotion, "record_promotion", full_disk)
    report = promote(save_dir, options, 10, requested=8)
    assert report.current == 8 and read_hold(save_dir).iteration == 8
    assert "promotion log not written" in report.message
    monkeypatch.undo()
    again = promote(save_dir, options, 10)  # the hold stands, and the log catches up
    assert again.current == 8
    # When the rollback happened is unknown: either value may have held since the last entry.
    assert pointer_during(save_dir, logged, logged) == {24, 8}
    assert pointer_during(save_dir, time.time(), time.time()) == {8}


def test_pointer_leaves_a_checkpoint_found_invalid_on_reverification(save_dir, options):
    promote(save_dir, options, 10)
    directory = iter_dir(save_dir, 24)
    flip_byte(directory / "__1_0.distcp", tensor_data_offset(directory, "__1_0.distcp"))
    assert verify_and_record_here(directory, options).state is State.INVALID
    report = promote(save_dir, options, 10)
    assert report.current == 20 and "iter_0000024" in report.message and "invalid" in report.message


def test_a_manifest_read_again_is_its_own_copy_and_new_bytes_are_parsed_anew(save_dir, options):
    """Promotion reads a manifest more than once and parses it once (by its bytes' digest): each
    reader gets its own copy, and a manifest rewritten since is never answered from the old one."""
    directory = iter_dir(save_dir, 24)
    assert verify_and_record_here(directory, options).state is State.VALID
    first, second = read_manifest(directory), read_manifest(directory)
    assert first == second and first is not second
    first.certification = {"ok": True}
    assert second.certification is None and read_manifest(directory).certification is None
    flip_byte(directory / "__1_0.distcp", tensor_data_offset(directory, "__1_0.distcp"))
    assert verify_and_record_here(directory, options).state is State.INVALID
    assert read_manifest(directory).status is State.INVALID


def test_explicit_iteration_must_be_valid(save_dir, options):
    report = promote(save_dir, options, 10, requested=8)
    assert report.current == 8 and read_pointer(save_dir) == 8
    directory = iter_dir(save_dir, 12)
    (directory / "__1_0.distcp").unlink()
    with pytest.raises(CkptopsError, match="iter_0000012: not promotable, it is invalid"):
        promote(save_dir, options, 10, requested=12)
    assert read_pointer(save_dir) == 8
    with pytest.raises(UsageError, match="--iteration 99: no such checkpoint"):
        promote(save_dir, options, 10, requested=99)


class LoggedSteps:
    """The cycle's steps, logging what the cycle asks of them; every checkpoint verifies valid
    except those ``still_saving``, which a wait reports in progress."""

    def __init__(self, still_saving=(), refused=()):
        self.calls, self.still_saving, self.refused = [], set(still_saving), list(refused)

    def wait(self, save_dir, iteration, options, waiting):
        self.calls.append(("wait", iteration, waiting.timeout_seconds))
        return Completeness(State.IN_PROGRESS if iteration in self.still_saving else None)

    def verify(self, save_dir, iteration, options, held, waiting):
        directory = save_dir / iter_dir_name(iteration)
        assert held.covers(directory)  # under the job lock
        self.calls.append(("verify", iteration, waiting and waiting.timeout_seconds))
        return Verification(directory, iteration, State.VALID, "fine")

    def promote(self, save_dir, options, requested):
        self.calls.append(("promote", requested))
        return PromotionReport(None, 8, "first promotion", refused=self.refused)

    def retain(self, save_dir, options, keep_verified):
        self.calls.append(("retain", keep_verified))
        return RetentionPlan(keep_verified, 8), [4]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_cycle_waits_for_a_save_before_verifying_or_inside_the_verify_step(tmp_path, overlap):
    """A save still being written is waited for before it is verified, or with verify.overlap_save
    inside the verify step (which reads its files as they settle); after a promotion, retention."""
    for iteration in (4, 8):
        iter_dir(tmp_path, iteration).mkdir()  # no metadata yet: both still being saved
    steps = LoggedSteps(still_saving=[8])
    options = VerifyOptions(job="cycle", overlap_save=overlap)
    report = promote(tmp_path, options, 1, steps=steps, waiting=Waiting(60, 1), keep_verified=2)
    if overlap:
        assert steps.calls[:2] == [("verify", 4, 60), ("verify", 8, 60)]
        assert [v.state for v in report.verifications] == [State.VALID, State.VALID]
    else:
        assert steps.calls[:3] == [("wait", 4, 60), ("verify", 4, None), ("wait", 8, 60)]
        assert [v.state for v in report.verifications] == [State.VALID, State.IN_PROGRESS]
    assert steps.calls[-2:] == [("promote", None), ("retain", 2)]
    assert report.deleted == [4] and "; retention deleted 4" in report.summary()


def test_the_cycle_without_waiting_verifies_at_once_and_a_refused_promotion_deletes_nothing(tmp_path):
    iter_dir(tmp_path, 4).mkdir()
    steps = LoggedSteps(refused=["iter_0000004: group-writable"])
    report = promote(tmp_path, VerifyOptions(job="cycle"), 1, steps=steps, keep_verified=2)
    assert steps.calls == [("verify", 4, None), ("promote", None)]
    assert report.retention is None and report.deleted == [] and not report.ok
