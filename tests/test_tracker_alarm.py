"""The alarm a plain ``--load`` needs: ``ckptops status`` raises ``ALERT`` (exit 1) when Megatron-LM's
tracker, or Megatron-Bridge's ``latest_train_state.pt``, names a checkpoint that is missing,
invalid, or complete and still not verified after ``verify.abandon_after_seconds``, whatever
ckptops wrote into it; on real Megatron-LM checkpoints (copies of the session's trained run)."""

import os
import time
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.state import State, VerifyOptions, completeness
from tasks.checkpoint.trackers import tracker_alarms
from tests.conftest import iter_dir
from tests.test_cli import ckptops_here

TRACKER = layout.MEGATRON_TRACKER
LOAD = "a job started with --load would resume from it; ckptops resumes only from the promoted checkpoint"


def _profile(tmp_path: Path, save_dir: Path) -> Path:
    """The save directory's own profile, its promotion alarm out of the way (the trained copy's
    saves are older than any interval they show)."""
    path = tmp_path / "profile.yaml"
    path.write_text(
        f"job: {{name: alarm-job, save_dir: '{save_dir}', megatron_core_version: '0.19.2', "
        "layout: {data_parallel: 2}}\n"
        "verify: {alert_after_seconds: 1000000000, abandon_after_seconds: 3600, lock_timeout_seconds: 30}\n"
    )
    return path


def _alerts(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("ALERT")]


def test_the_tracker_naming_a_checkpoint_found_invalid_is_an_alarm(save_dir, tmp_path):
    """24's save is complete (save health has nothing to say) but verification found a shard
    missing: Megatron-LM's tracker still names it, and a --load would take it."""
    profile = _profile(tmp_path, save_dir)
    (iter_dir(save_dir, 24) / "__1_0.distcp").unlink()
    promoted = ckptops_here("promote", "--profile", profile)
    assert promoted.exit_code == 1 and (save_dir / layout.POINTER).read_text().strip() == "20"
    assert (save_dir / TRACKER).read_text().strip() == "24"
    shown = ckptops_here("status", "--profile", profile)
    assert shown.exit_code == 1, shown.output
    [alert] = _alerts(shown.output)
    invalid = "which is invalid (__1_0.distcp: referenced by .metadata but missing [files]"
    assert alert.startswith(f"ALERT {save_dir / TRACKER} names iteration 24, {invalid}") and alert.endswith(
        LOAD
    )
    # Pointed at 20, valid, it is quiet again.
    (save_dir / TRACKER).write_text("20\n")
    assert ckptops_here("status", "--profile", profile).exit_code == 0


def test_the_tracker_naming_a_missing_checkpoint_is_an_alarm(save_dir, tmp_path):
    profile = _profile(tmp_path, save_dir)
    (save_dir / TRACKER).write_text("28\n")
    shown = ckptops_here("status", "--profile", profile)
    assert shown.exit_code == 1
    [alert] = _alerts(shown.output)
    assert alert.startswith(
        f"ALERT Megatron-LM's tracker {TRACKER} names iteration 28, which is not complete"
    )


def test_the_tracker_naming_a_checkpoint_never_verified_past_the_abandon_time_is_an_alarm(save_dir, tmp_path):
    profile = _profile(tmp_path, save_dir)
    two_hours_ago = time.time() - 7200
    for path in iter_dir(save_dir, 24).iterdir():
        os.utime(path, (two_hours_ago, two_hours_ago))
    shown = ckptops_here("status", "--profile", profile)
    assert shown.exit_code == 1
    assert _alerts(shown.output) == [
        f"ALERT {save_dir / TRACKER} names iteration 24, which has been complete for 2.0 h and is not "
        f"known valid (not verified yet); verify.abandon_after_seconds is 3600: {LOAD}"
    ]


def test_megatron_bridges_resume_file_naming_a_missing_checkpoint_is_an_alarm(tmp_path):
    import torch

    save_dir = tmp_path / "save"
    save_dir.mkdir()
    torch.save(
        {"step": torch.tensor(28), "consumed_train_samples": torch.tensor(0)},
        save_dir / "latest_train_state.pt",
    )
    options = VerifyOptions(job="bridge")
    [alarm] = tracker_alarms(save_dir, [], options)
    assert (
        alarm.line()
        == f"ALERT {save_dir / 'latest_train_state.pt'} names iteration 28, which does not exist: {LOAD}"
    )
    (save_dir / "latest_train_state.pt").write_bytes(b"not a torch file")
    [alarm] = tracker_alarms(save_dir, [], options)
    assert alarm.iteration is None and alarm.line().startswith(
        f"ALERT {save_dir / 'latest_train_state.pt'} cannot be read, "
    )


def test_a_manifest_ckptops_wrote_never_makes_a_dead_save_look_active(tmp_path):
    """A save whose shards stopped hours ago, without metadata.json, is abandoned: a manifest
    ckptops writes into it afterwards (verify of that iteration) does not make it look written
    to again, which would hide the tracker's alarm for abandon_after_seconds."""
    directory = tmp_path / "save" / "iter_0000008"
    directory.mkdir(parents=True)
    hours_ago = time.time() - 3 * 3600
    (directory / "__0_0.distcp").write_bytes(b"x")
    os.utime(directory / "__0_0.distcp", (hours_ago, hours_ago))
    (directory / layout.MANIFEST).write_text("{}\n")
    done = completeness(directory, VerifyOptions(job="test", abandon_after_seconds=3600))
    assert done.state is State.INVALID and done.reason.startswith("metadata.json: missing, no change for")


def test_a_fifo_at_megatrons_tracker_is_named_never_waited_on(tmp_path):
    """Save health read the tracker with a plain open: a FIFO there hung status and the flow. One
    reader for both now: the tracker is not an iteration, and the alarm says why."""
    from tasks.checkpoint.saves import read_tracker

    save_dir = tmp_path / "checkpoints"
    save_dir.mkdir()
    os.mkfifo(save_dir / TRACKER)
    assert read_tracker(save_dir) is None
    [alarm] = tracker_alarms(save_dir, [], VerifyOptions(job="fifo"))
    assert alarm.iteration is None and "a FIFO, not a regular file" in alarm.why
