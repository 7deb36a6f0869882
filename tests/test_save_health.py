"""Save health: saves that stall, fail half-way or fill the store are seen from the store and the
job's log, never promoted or resumed from, named by triage, and measured for the interval advice.

The logs under tests/data/megatron/saves/ are Megatron-LM's own lines (its SOURCES.md); the faults
are injected into Megatron-LM's loop (infra/local_job/faults.py --break-save), and the full store is
a real size-limited tmpfs (as root): the kernel's ENOSPC.
"""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from infra.local_job.launch import start_local_job, wait_local_job
from tasks.checkpoint.saves import SaveState, save_report, saves_of
from tasks.checkpoint.state import VerifyOptions
from tasks.cluster.process import Failed
from tasks.job.save_log import merged, read_save_log, stalled_in
from tasks.profile import load_profile
from tasks.recovery.triage import triage
from tests.conftest import iter_dir
from tests.test_cli import ckptops_here

SAVES = Path(__file__).parent / "data" / "megatron" / "saves"
ASYNC = ["--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]


def read(name: str):
    return read_save_log((SAVES / name).read_text().splitlines(), name)


# The log reader, on Megatron-LM's own lines.


def test_megatron_lms_synchronous_and_async_saves_are_read_with_their_times():
    sync = read("sync_ok.log")
    assert list(sync.saves) == [4, 8]
    assert all(s.done and not s.asynchronous for s in sync.saves.values())
    assert [s.blocking_seconds for s in sync.saves.values()] == pytest.approx([0.24921, 0.16009])  # max
    assert sync.ended and stalled_in(sync) is None
    saved = sync.saves[4]
    assert 0 < saved.finished - saved.began < saved.blocking_seconds

    background = read("async_ok.log")
    assert list(background.saves) == [4, 8, 12]
    first = background.saves[4]
    assert first.asynchronous and first.blocking_seconds == pytest.approx(2.74547)
    # Scheduled at 04:50:11.980799, finalized at 04:50:14.975228 by a later iteration.
    assert first.background_seconds == pytest.approx(2.994429, abs=1e-5)
    assert all(s.done for s in background.saves.values())


def test_a_full_store_is_the_saves_error_even_where_torch_does_not_say_so():
    """ENOSPC on a real tmpfs: the synchronous save's writer reports only torch's zip writer
    ("unexpected pos"), the async one the errno; both are the save of iteration 12's error, and
    the job's end leaves it unfinished."""
    for name, says_space in (("sync_enospc.log", False), ("async_enospc.log", True)):
        log = read(name)
        save = log.saves[12]
        assert not save.done and save.ended_with_job
        assert save.error.startswith("ERROR:megatron.core.dist_checkpointing.strategies.filesystem_async:")
        assert save.out_of_space is says_space, name
        assert log.saves[8].error is None and log.saves[8].done
        found = triage([SAVES / name])
        assert (found.cls, found.save_iteration) == ("save-failed", 12), found.reason
        assert "the save of iteration 12 failed" in found.reason


def test_older_megatron_lm_wording_and_a_save_overtaken_by_the_next():
    """Releases before the timestamps print "successfully saved checkpoint at iteration"; an
    error is the oldest unfinished save's (Megatron-LM finalizes in order); a save still
    unfinished when the next began is stuck even though steps were logged after it."""
    log = read_save_log(
        [
            "saving checkpoint at iteration     100 to /ckpt",
            "  successfully saved checkpoint at iteration     100 to /ckpt",
            " iteration      101/    1000 | consumed samples: 808 | lm loss: 2.0 |",
            "saving checkpoint at iteration     200 to /ckpt",
            " iteration      201/    1000 | consumed samples: 1608 | lm loss: 2.0 |",
            "saving checkpoint at iteration     300 to /ckpt",
            "Traceback (most recent call last):",
            '  File "/opt/megatron/megatron/training/checkpointing.py", line 480, in save_checkpoint',
            "    torch.save(state_dict, checkpoint_name)",
            "OSError: [Errno 122] Disk quota exceeded",
        ]
    )
    assert log.saves[100].done and log.saves[100].began is None  # no timestamps
    assert log.saves[200].error == "OSError: [Errno 122] Disk quota exceeded"
    assert log.saves[200].error_line == 10
    assert log.saves[200].out_of_space and log.saves[300].error is None
    assert log.saves[300].stuck and not log.saves[200].stuck  # 200 failed; 300 never finished
    behind = read_save_log(
        [
            "saving checkpoint at iteration 4 to /c",
            "scheduled an async checkpoint save at iteration 4 to /c",
            " iteration        5/      12 | consumed samples: 40 |",
        ]
    )
    assert not behind.saves[4].stuck  # a write behind logged steps is an async save at work
    # The last rank's line of the save's own iteration may come after rank 0's "saving" line.
    interleaved = read_save_log(
        ["saving checkpoint at iteration 8 to /c", " iteration        8/       8 | consumed samples: 64 |"]
    )
    assert interleaved.saves[8].stuck


def test_the_saves_of_per_rank_logs_are_merged():
    first = read_save_log(["saving checkpoint at iteration 4 to /c"], "rank0")
    second = read_save_log(
        ["saving checkpoint at iteration 4 to /c", "  successfully saved checkpoint from iteration 4 to /c"],
        "rank1",
    )
    both = merged([first, second])
    assert both.saves[4].done and stalled_in(both) is None


# Save states from the store.


def test_saves_the_log_says_finished_and_retention_removed_are_history_not_alarms(tmp_path):
    """A long job's log holds every save it ever made; the store keeps the newest few."""
    found = save_report(tmp_path, VerifyOptions(job="j"), read("sync_ok.log"), stall_seconds=60)
    assert found.saves == [] and found.alarms() == []
    empty = tmp_path / "iter_0000016"
    empty.mkdir()  # a save that made its directory and wrote nothing since
    os.utime(empty, (time.time() - 300, time.time() - 300))
    (stuck,) = save_report(tmp_path, VerifyOptions(job="j"), stall_seconds=60).saves
    assert (stuck.state, stuck.files) == (SaveState.STALLED, 0) and stuck.reason.startswith(
        "no byte written for 30"
    )
    empty.rmdir()
    cut = read_save_log((SAVES / "sync_enospc.log").read_text().splitlines())
    (failed,) = save_report(tmp_path, VerifyOptions(job="j"), cut).saves
    assert (failed.iteration, failed.state, failed.files) == (12, SaveState.FAILED, 0)


@pytest.fixture
def store(save_dir) -> Path:
    """A copy of real checkpoints (4..24) whose newest save is cut short: 24 without its metadata
    and rank 1's shard, and Megatron-LM's tracker still on 20, as a save under way leaves them."""
    newest = iter_dir(save_dir, 24)
    for name in (".metadata", "metadata.json", "integrity.json", "__1_0.distcp"):
        (newest / name).unlink(missing_ok=True)
    (save_dir / "latest_checkpointed_iteration.txt").write_text("20")
    for path in newest.iterdir():  # written just now (the copy keeps the training run's times)
        os.utime(path)
    return save_dir


def test_a_save_without_metadata_is_writing_then_stalled_with_its_missing_ranks(store):
    options = VerifyOptions(job="test-job")
    fresh = save_report(store, options, stall_seconds=60, world_size=2)
    newest = fresh.saves[-1]
    assert (newest.iteration, newest.state, newest.missing_ranks) == (24, SaveState.WRITING, [1])
    assert all(s.state is SaveState.COMPLETE for s in fresh.saves[:-1])
    assert fresh.alarms() == []
    later = save_report(store, options, stall_seconds=60, world_size=2, now=time.time() + 120)
    stalled = later.saves[-1]
    assert stalled.state is SaveState.STALLED and stalled.alarming
    (line,) = later.alarms()
    assert line.startswith("ALERT save iter_0000024 stalled: no byte written for ")
    assert "no shard from rank(s) 1" in line


def test_the_log_decides_a_failed_save_and_the_tracker_ahead_of_the_data_is_an_alarm(store):
    options = VerifyOptions(job="test-job")
    log = read_save_log(
        [
            "[2026-12-07 04:50:53.945097] saving checkpoint at iteration      24 to /ck in torch_dist format",
            "[rank0]: OSError: [Errno 5] Input/output error: '/ck/iter_0000024/__0_0.distcp'",
        ]
    )
    (store / "latest_checkpointed_iteration.txt").write_text("24")
    found = save_report(store, options, log, world_size=2)
    failed = found.saves[-1]
    assert (
        failed.state is SaveState.FAILED
        and failed.error == "[rank0]: OSError: [Errno 5] Input/output error: '/ck/iter_0000024/__0_0.distcp'"
    )
    assert not failed.out_of_space  # an I/O error, and the disk has room
    assert found.tracker == 24
    assert found.tracker_problem.startswith(
        "Megatron-LM's tracker latest_checkpointed_iteration.txt names iteration 24, which is not complete"
    )
    assert set(found.alarm_lines()) == {"save 24 failed", "tracker 24"}
    # A later save that completed makes the failed one history: listed, no alarm.
    (store / "latest_checkpointed_iteration.txt").write_text("20")
    shutil.copytree(iter_dir(store, 20), iter_dir(store, 28))
    assert save_report(store, options, log, world_size=2).alarms() == []


def test_a_profile_margin_the_store_cannot_keep_is_an_alarm_before_the_next_save(store, tmp_path):
    free = os.statvfs(store).f_bavail * os.statvfs(store).f_frsize
    profile = tmp_path / "p.yaml"
    profile.write_text(
        yaml.safe_dump(
            {
                "job": {"name": "test-job", "save_dir": str(store), "layout": {"data_parallel": 2}},
                "verify": {"space_margin_gb": free * 2 / 1e9},
            }
        )
    )
    prof = load_profile(str(profile))
    found = saves_of(prof, store, VerifyOptions.from_profile(prof))
    assert found.space.short and list(found.alarm_lines()) == ["space"]
    assert found.alarms()[0].startswith(f"ALERT the next save will not fit: store {store}: ")
    shown = ckptops_here("status", "--profile", profile)
    assert shown.exit_code == 1 and "ALERT the next save will not fit" in shown.stdout


# Faults injected into Megatron-LM's loop.


def _profile(tmp_path: Path, save: Path, **verify) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "job": {"name": "job", "save_dir": str(save), "layout": {"data_parallel": 2}},
                "verify": {"lock_timeout_seconds": 30, **verify},
                "retention": {"keep_verified": 2},
                "recovery": {
                    "launcher": "local",
                    "script": str(tmp_path / "job.sh"),
                    "auto_approve": ["save-failed"],
                },
            }
        )
    )
    (tmp_path / "job.sh").write_text("#!/bin/bash\nexit 0\n")
    return path


@pytest.fixture
def small_store(tmp_path):
    """A 4 MB tmpfs mounted as the save directory (mode 0755: a world-writable one is never
    promoted): two of the tiny job's 1.6 MB checkpoints fit, a third does not. Needs root (CI
    and this project's machines run the suite as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "checkpoints"
    mount.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(mount)], check=True, timeout=30
    )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


@pytest.mark.slow
def test_a_store_that_fills_up_is_named_never_promoted_and_never_relaunched_into(small_store, tmp_path):
    """The kernel's ENOSPC half-way through the save of 12: the save is failed by the store and
    the log, the alarm names it and the store's free space, triage says save-failed, a recovery
    stops with the space needed instead of relaunching into the full store, promotion never
    touches 12, and the advice reads the measured saves from the job's log."""
    log = tmp_path / "train.log"
    job, _ = start_local_job(small_store, train_iters=12, save_interval=4, log=log)
    with pytest.raises(Failed):
        wait_local_job(job, log, 300)
    profile = _profile(tmp_path, small_store, save_stall_seconds=600)
    options = VerifyOptions.from_profile(load_profile(str(profile)))

    found = save_report(small_store, options, read_save_log(log.read_text().splitlines()), world_size=2)
    states = {s.iteration: s.state for s in found.saves}
    assert states == {4: SaveState.COMPLETE, 8: SaveState.COMPLETE, 12: SaveState.FAILED}
    assert found.saves[-1].out_of_space and found.space.free_bytes < found.space.needed_bytes
    shown = ckptops_here("status", "--log", log, "--profile", profile)
    assert shown.exit_code == 1, shown.stdout
    alert = next(
        line for line in shown.stdout.splitlines() if line.startswith("ALERT save iter_0000012 failed")
    )
    assert f"store {small_store}: " in alert and "free of 4.2 MB; a checkpoint needs 1.6 MB" in alert

    told = ckptops_here("triage", log, "--json")
    assert told.exit_code == 0, told.stdout + told.stderr
    told = json.loads(told.stdout)
    assert (told["class"], told["save_iteration"]) == ("save-failed", 12)

    # Not a byte left: the recovery cannot even take its lock, and says which file, relaunching
    # nothing.
    refused = ckptops_here("recover", "--logs", log, "--json", "--profile", profile)
    last = refused.stderr.splitlines()[-1]
    assert refused.exit_code == 2 and last.startswith(f"ckptops: {small_store}/.ckptops-"), refused.stderr
    assert last.endswith(": No space left on device")
    # A person removes the failed save, as the alarm says: the store still cannot take a save, so
    # the recovery stops instead of relaunching, with the space needed and free.
    shutil.rmtree(iter_dir(small_store, 12))
    recovered = ckptops_here("recover", "--logs", log, "--json", "--profile", profile)
    assert recovered.stdout.startswith("{"), recovered.stdout + recovered.stderr
    incident = json.loads(recovered.stdout)
    assert recovered.exit_code == 1 and incident["relaunched_job"] is None
    assert (incident["class"], incident["outcome"]) == ("save-failed", "stopped")
    assert incident["reason"].startswith(f"the store cannot take the next save: store {small_store}: ")
    assert "a checkpoint needs 1.6 MB; retention (keep_verified 2) could free 0 B" in incident["reason"]
    # Its verification of 4 and 8 promoted 8; 12 was never a candidate.
    assert (small_store / "latest_verified_iteration.txt").read_text().strip() == "8", incident
    assert ckptops_here("status", "--log", log, "--profile", profile).exit_code == 1  # still short

    advised = ckptops_here(
        "goodput",
        "advise",
        "--log",
        log,
        "--mtbf-hours",
        "24",
        "--restart-minutes",
        "5",
        "--profile",
        profile,
    )
    assert advised.exit_code == 0, advised.stdout
    assert f"saves measured (save timers in {log}): 2; blocking median " in advised.stdout


@pytest.mark.slow
def test_an_async_writer_killed_mid_save_is_stalled_within_a_poll_then_failed_and_triaged(tmp_path):
    """Rank 1's async checkpoint worker is SIGKILLed as the save of 8 is handed to it: its peers
    wait in finalization (Megatron-LM #6970). ckptops sees the save stalled while the job hangs,
    failed once it ended, never promotes it, and triage names the hang save-stalled at 8."""
    save = tmp_path / "checkpoints"
    log = tmp_path / "train.log"
    extra = [*ASYNC, "--break-save", "8:kill-writer", "--distributed-timeout-seconds", "10"]
    job, _ = start_local_job(save, train_iters=8, save_interval=4, log=log, extra=extra)
    profile = _profile(tmp_path, save, save_stall_seconds=2)
    prof = load_profile(str(profile))
    options = VerifyOptions.from_profile(prof)
    seen = None
    while job.poll() is None:
        found = saves_of(prof, save, options, log)
        seen = next((s for s in found.saves if s.iteration == 8 and s.state is SaveState.STALLED), seen)
        if seen is not None:
            break
        time.sleep(0.5)  # the poll interval of a watcher, not a synchronisation
    with pytest.raises(Failed):
        wait_local_job(job, log, 300)
    assert seen is not None, "the save of 8 was never seen stalled while the job hung"
    assert seen.missing_ranks == [1] and seen.reason.startswith("no byte written for ")
    after = saves_of(prof, save, options, log)
    ended = {s.iteration: s for s in after.saves}
    assert ended[4].state is SaveState.COMPLETE
    assert (
        ended[8].state is SaveState.FAILED
        and ended[8].reason == "the job ended while it was writing (its log)"
    )
    told = triage([log])
    assert (told.cls, told.save_iteration) == ("save-stalled", 8), told.reason
    assert "saving checkpoint at iteration       8" in told.first_error.text
    promoted = ckptops_here("promote", "--profile", profile)
    assert (save / "latest_verified_iteration.txt").read_text().strip() == "4", promoted.stdout


def _broken(tmp_path: Path, fault: str) -> tuple[Path, Path]:
    """The save directory and log of the local job trained up to the save ``fault`` breaks
    (``ITERATION:KIND``), which ends it: a rank dies, its peers' collective times out."""
    save, log = tmp_path / "checkpoints", tmp_path / "train.log"
    extra = ["--break-save", fault, "--distributed-timeout-seconds", "10"]
    job, _ = start_local_job(
        save, train_iters=int(fault.split(":")[0]), save_interval=4, log=log, extra=extra
    )
    with pytest.raises(Failed):
        wait_local_job(job, log, 300)
    return save, log


@pytest.mark.slow
def test_a_tracker_written_before_the_data_is_an_alarm_and_never_resumed_from(tmp_path):
    """Rank 0 writes Megatron-LM's tracker naming 8 before the data (Megatron-Bridge PR #5746),
    rank 1 dies before its shard: the tracker names an iteration that is not complete, the alarm
    says so, and the pointer (what a recovery resumes from) stays on 4."""
    save, log = _broken(tmp_path, "8:tracker-first")
    profile = _profile(tmp_path, save)
    shown = ckptops_here("status", "--log", log, "--profile", profile)
    assert shown.exit_code == 1
    tracker = "ALERT Megatron-LM's tracker latest_checkpointed_iteration.txt names iteration 8, "
    assert f"{tracker}which is not complete (it is failed, nothing written)" in shown.stdout
    failed = "ALERT save iter_0000008 failed: the job ended while it was writing (its log); "
    assert f"{failed}0 file(s), 0 B written; no shard from rank(s) 0, 1" in shown.stdout
    told = triage([log])
    assert (told.cls, told.save_iteration) == ("save-stalled", 8), told.reason  # rank 1 died in it
    ckptops_here("promote", "--profile", profile)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert (save / "latest_verified_iteration.txt").read_text().strip() == "4"


@pytest.mark.slow
def test_a_rank_killed_between_the_last_shard_and_the_tracker_leaves_a_complete_save(tmp_path):
    """Rank 0 dies once every shard and the metadata of 4 are written, before the tracker: the
    log never says the save succeeded and the job ended, but the store holds the whole save, so it
    is complete (the store decides), verified and promoted; the tracker is not ahead of anything."""
    save, log = _broken(tmp_path, "4:kill-before-tracker")
    logged = read_save_log(log.read_text().splitlines()).saves[4]
    assert not logged.done and logged.ended_with_job
    assert not (save / "latest_checkpointed_iteration.txt").exists()
    profile = _profile(tmp_path, save)
    prof = load_profile(str(profile))
    found = saves_of(prof, save, VerifyOptions.from_profile(prof), log)
    assert [(s.iteration, s.state) for s in found.saves] == [(4, SaveState.COMPLETE)]
    assert found.alarms() == []
    promoted = ckptops_here("promote", "--profile", profile)
    assert promoted.exit_code == 0, promoted.stdout
    assert (save / "latest_verified_iteration.txt").read_text().strip() == "4"


def test_the_advice_measures_an_async_jobs_blocking_and_background_writes_apart(variety, tmp_path):
    """The async-wsd variant saved 2 and 4 through Megatron-LM's persistent worker: the advice
    keeps the timers' blocking time as C and reports each background write and its overlap."""
    from tests.conftest import variant_profile

    log = variety["async-wsd"].parent / "async-wsd-train.log"
    profile = variant_profile(variety, "async-wsd", tmp_path)
    given = ("--mtbf-hours", "24", "--restart-minutes", "5", "--profile", profile, "--log", log)
    advised = ckptops_here("goodput", "advise", *given, "--json")
    assert advised.exit_code == 0, advised.stdout
    found = json.loads(advised.stdout)
    saves = read_save_log(log.read_text().splitlines())
    assert found["saves"]["blocking"] == pytest.approx([s.blocking_seconds for s in saves.saves.values()])
    assert found["save_seconds"] == pytest.approx(
        sorted(found["saves"]["blocking"])[0] / 2 + sorted(found["saves"]["blocking"])[1] / 2
    )
    assert len(found["saves"]["background"]) == 2 and all(b > 0 for b in found["saves"]["background"])
    assert len(found["saves"]["store"]) == 2  # first data file to .metadata, for 2 and 4
    text = ckptops_here("goodput", "advise", *given).stdout
    assert "async background writes: 2; median " in text


WANDB_FULL = (
    "wandb: WARNING Failed to cache artifact: [Errno 28] No space left on device: "
    "'/root/.cache/wandb/artifacts/obj/tmp1234'"
)


def test_a_save_error_counts_only_in_its_writers_words_or_naming_its_directory(store):
    """Another program's full disk (a wandb cache) during a save is not the save's failure; the
    same words naming the save's directory, in Megatron-Core's writer's log line, or ending a
    traceback through a checkpoint writer's frames are."""
    began = "[2026-12-07 04:50:53.945097] saving checkpoint at iteration      24 to /ck in torch_dist format"
    log = read_save_log([began, WANDB_FULL, "[rank0]: OSError: [Errno 28] No space left on device"])
    assert log.saves[24].error is None
    found = save_report(store, VerifyOptions(job="test-job"), log, world_size=2)
    assert not any(s.state is SaveState.FAILED or s.out_of_space for s in found.saves)
    assert not any("out of space" in line or "failed" in line for line in found.alarm_lines())
    for owned in (
        "[rank0]: OSError: [Errno 28] No space left on device: '/ck/iter_0000024/__0_0.distcp'",
        "ERROR:megatron.core.dist_checkpointing.strategies.filesystem_async:Local worker 0 encountered "
        "an error: [Errno 28] No space left on device",
    ):
        assert read_save_log([began, WANDB_FULL, owned]).saves[24].error == owned
    traced = read_save_log(
        [
            began,
            "[rank0]: Traceback (most recent call last):",
            '[rank0]:   File "/usr/lib/python3/site-packages/torch/serialization.py", line 379, in save',
            "[rank0]:     _save(obj, opened_zipfile, pickle_module, pickle_protocol)",
            "[rank0]: OSError: [Errno 28] No space left on device",
        ]
    )
    assert traced.saves[24].error == "[rank0]: OSError: [Errno 28] No space left on device"
    assert traced.saves[24].out_of_space


def test_triage_keeps_a_nan_failure_beside_another_programs_full_disk(tmp_path):
    nan = (
        "ERROR:megatron.core.rerun_state_machine:Unexpected result nan on rank 1 at iteration #25 "
        "invocation #1 (message='found NaN in local grad norm')"
    )
    log = tmp_path / "job.log"
    log.write_text(
        "[2026-12-07 04:50:53.945097] saving checkpoint at iteration 24 to /ck in torch_dist format\n"
        f"[2026-12-07 04:50:54] {WANDB_FULL}\n[2026-12-07 04:50:55] {nan}\n"
    )
    found = triage([log])
    assert found.cls == "numerics", found.reason
    assert all(e.cls != "save-failed" for e in found.evidence)


def test_a_full_disk_through_activation_checkpointing_is_no_save_failure(tmp_path):
    """torch/utils/checkpoint.py is activation checkpointing (a recompute in the backward pass),
    not a checkpoint writer: an ENOSPC ending a traceback through it (a spill, a cache) is not the
    save's; the same words ending a traceback through a writer's module are."""
    began = "[2026-12-07 04:50:53.945097] saving checkpoint at iteration      24 to /ck in torch_dist format"
    enospc = "[rank0]: OSError: [Errno 28] No space left on device"
    recompute = [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/venv/site-packages/torch/utils/checkpoint.py", line 1128, in unpack_hook',
        "[rank0]:     frame.recompute_fn(*args)",
        enospc,
    ]
    assert read_save_log([began, *recompute]).saves[24].error is None
    log = tmp_path / "job.log"
    log.write_text("\n".join([began, *recompute]) + "\n")
    assert triage([log]).cls != "save-failed"
    for writer in (
        "/opt/megatron/megatron/core/dist_checkpointing/strategies/filesystem_async.py",
        "/opt/megatron/megatron/training/checkpointing.py",
        "/usr/lib/python3/site-packages/torch/distributed/checkpoint/filesystem.py",
        "/usr/lib/python3/site-packages/torch/serialization.py",
        "/opt/Megatron-Bridge/src/megatron/bridge/training/checkpointing.py",
    ):
        traced = [recompute[0], f'[rank0]:   File "{writer}", line 379, in save', "[rank0]:     x()", enospc]
        assert read_save_log([began, *traced]).saves[24].error == enospc, writer
        log.write_text("\n".join([began, *traced]) + "\n")
        assert triage([log]).cls == "save-failed", writer
