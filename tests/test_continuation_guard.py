"""The continuation drill kept out of production (issue 56): what no script can put back in the
job's save directory (ctimes, the trackers' bytes, the set of iterations), every save Megatron-LM
can be told to make kept inside the drill's scratch, the promoted checkpoint read again whole
after the run, children that leave the run's session ended with it, and the script reader's
commands and comments. The real runs use Megatron-LM's own loop (``tests/test_continuation.py``'s
profile and scripts)."""

import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.checkpoint.manifest import read_manifest
from tasks.cluster import process
from tasks.errors import UsageError
from tasks.profile import load_profile
from tasks.relaunch.fit import Compatibility
from tasks.relaunch.printed import PrintedArgs
from tasks.relaunch.script import script_args
from tasks.restore import continuation
from tasks.restore.continuation import _misfit, _resumable, changes, continuation_sources, fingerprint
from tasks.restore.drill import run_drill
from tests.conftest import iter_dir, write_job_profile
from tests.helpers.poll import line_from_fifo
from tests.test_continuation import INTEGRITY, _production, continuation_profile

# One of Megatron-LM's iteration lines: the original run's log a continuation is compared with.
ITERATION = (
    " [2026-12-07 19:36:41.385023] iteration        1/      24 | consumed samples:            8 | "
    "learning rate: 5.000000E-04 | global batch size:     8 | lm loss: 4.846237E+00 | loss scale: 1.0 | "
    "grad norm: 1.344 | number of skipped iterations:   0 | number of nan iterations:   0 |\n"
)


def _after(tmp_path: Path, change) -> str | None:
    save = _production(tmp_path / "save")
    before = fingerprint(save, set())
    change(save)
    return changes(before, fingerprint(save, set()))


def _rewritten_in_place(path: Path, data: bytes) -> None:
    """``data`` written over the start of ``path``, its size and mtime put back (``touch -r``)."""
    was = path.stat()
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(was.st_atime_ns, was.st_mtime_ns))


def test_a_shard_rewritten_in_place_with_its_mtime_put_back_is_a_change(tmp_path):
    """Before: kind, size, mtime and inode were the same, so nothing had changed."""
    shard = Path("iter_0000020") / "__0_0.distcp"
    assert _after(tmp_path, lambda save: _rewritten_in_place(save / shard, b"evil")) == (
        f"{shard} changed (ctime)"
    )


def test_a_tracker_written_again_or_moved_is_a_change_whatever_its_stamps_say(tmp_path):
    tracker = "latest_checkpointed_iteration.txt"
    assert _after(tmp_path, lambda save: _rewritten_in_place(save / tracker, b"24")) == (
        f"{tracker} was written (ctime)"
    )
    (tmp_path / "save").rename(tmp_path / "first")
    assert _after(tmp_path, lambda save: _rewritten_in_place(save / tracker, b"28")) == (
        f"{tracker} went from 24 to 28"
    )


def test_megatron_bridges_tracker_and_data_loader_states_are_fingerprinted(tmp_path):
    def bridge(save: Path) -> Path:
        (save / "latest_train_state.pt").write_bytes(b"\x80\x02 iteration 24")
        (save / "energon" / "iter_0000024").mkdir(parents=True)
        (save / "energon" / "iter_0000024" / "train_dataloader_dprank000.pt").write_bytes(b"state")
        return save

    save = bridge(_production(tmp_path / "save"))
    before = fingerprint(save, set())
    (save / "latest_train_state.pt").write_bytes(b"\x80\x02 iteration 28")
    (save / "energon" / "iter_0000028").mkdir()
    (save / "energon" / "iter_0000028" / "train_dataloader_dprank000.pt").write_bytes(b"state")
    assert changes(before, fingerprint(save, set())) == (
        "energon/iter_0000028 appeared, a new iteration in production while the continuation ran; "
        "latest_train_state.pt was rewritten"
    )


def test_a_fifo_planted_as_a_tracker_is_fingerprinted_not_read(tmp_path):
    """A FIFO with no writer would block a plain read for ever."""
    save = _production(tmp_path / "save")
    before = fingerprint(save, set())
    (save / "latest_checkpointed_iteration.txt").unlink()
    os.mkfifo(save / "latest_checkpointed_iteration.txt")
    found = fingerprint(save, set())
    assert "a FIFO, not a regular file" in found["latest_checkpointed_iteration.txt"][-1]
    assert changes(before, found) == "latest_checkpointed_iteration.txt was rewritten"


def _printed(**values: str) -> PrintedArgs:
    return PrintedArgs(
        {"save": "/scratch/continuation-save", "load": "/scratch/restore", **values}, Path("log"), 3
    )


@pytest.mark.parametrize(
    ("name", "value", "refused"),
    [
        ("ckpt_convert_save", "/ckpt/job", True),
        ("ckpt_convert_save", "/scratch/continuation-save/converted", False),
        ("non_persistent_global_ckpt_dir", "/ckpt/job/non_persistent", True),
        ("non_persistent_local_ckpt_dir", "/local/ckpt", True),
        ("non_persistent_local_ckpt_dir", "None", False),
    ],
)
def test_every_save_megatron_lm_makes_must_lie_inside_ckpt_save(name, value, refused, tmp_path):
    """Megatron-LM's training.py saves the loaded checkpoint converted, tracker and all, into
    ``join(ckpt_convert_save, format)`` before any iteration; its non-persistent saves go to
    their own directories. Before: only save and the global non-persistent one were judged."""
    scratch = tmp_path / "scratch"
    (scratch / "continuation-save").mkdir(parents=True)
    (scratch / "restore").mkdir()
    value = value.replace("/scratch", str(scratch))
    env = {"CKPT_SAVE": str(scratch / "continuation-save"), "CKPT_LOAD": str(scratch / "restore")}
    printed = PrintedArgs(
        {"save": env["CKPT_SAVE"], "load": env["CKPT_LOAD"], name: value}, Path("run.log"), 3
    )
    said = _misfit(printed, Compatibility(16, "job.sh", 0), env, None)
    if not refused:
        assert said is None
        return
    assert said == (
        f"{name} is {value}, not inside CKPT_SAVE {env['CKPT_SAVE']}: it would save outside the "
        "drill's scratch (printed at run.log:3)"
    )


def test_a_script_that_names_ckpt_load_only_in_a_comment_is_refused(tmp_path):
    script = tmp_path / "job.sh"
    settings = SimpleNamespace(script=script, reference=tmp_path / "train.log")
    profile = SimpleNamespace(source="p.yaml", drill=SimpleNamespace(continuation=settings), recovery=None)
    (tmp_path / "train.log").write_text(ITERATION)
    script.write_text(
        "#!/bin/bash\n# reads CKPT_LOAD, honest\ntorchrun pretrain_gpt.py --load /ckpt/job  # CKPT_LOAD\n"
    )
    with pytest.raises(UsageError, match=f"^{script}: does not read CKPT_LOAD"):
        continuation_sources(profile)
    for reads in ('--load "$CKPT_LOAD"', "--load ${CKPT_LOAD:-/ckpt}", "<<EOF\nload: $CKPT_LOAD\nEOF"):
        script.write_text(f"#!/bin/bash\n# a comment\ntorchrun pretrain_gpt.py {reads}\n")
        assert continuation_sources(profile)[0] == script, reads


def test_two_commands_on_one_continued_line_are_read_as_two(tmp_path):
    """Before: the line was one command, so the second --lr replaced the first, as argparse
    takes a repeated flag, instead of being named as set twice."""
    script = tmp_path / "job.sh"
    for joined in (";", "&&", "||", "|", "&"):
        script.write_text(
            f"#!/bin/bash\ntorchrun pretrain_gpt.py --lr 1e-4 \\\n  --num-layers 2 {joined} torchrun \\\n"
            "  pretrain_gpt.py --lr 2e-4 --num-layers 2\n"
        )
        found = script_args(script, {})
        assert found.unresolved["lr"] == "the script sets it more than once (1e-4; 2e-4)", joined
        assert found.values["num_layers"] == 2 and "lr" not in found.values, joined


def _escaping(tmp_path: Path, then: str) -> tuple[subprocess.Popen, int]:
    """A command whose child leaves its session (``setsid -f``: reparented to init before any
    poll of the command's children can note it), then runs ``then``; and that child's pid, which
    it writes into a FIFO once it runs."""
    fifo = tmp_path / f"escaped-{len(list(tmp_path.iterdir()))}.pid"
    os.mkfifo(fifo)
    script = f"setsid -f bash -c 'echo $$ > {fifo}; exec sleep 300'\n{then}"
    started = process.start(["bash", "-c", script], tmp_path / "log")
    return started, int(line_from_fifo(fifo, 60, "the escaping child ran"))


def test_a_child_that_left_the_session_is_ended_with_the_command(tmp_path):
    """Before: it outlived the command, which had ended and been waited for."""
    started, escaped = _escaping(tmp_path, "exit 0\n")
    process.wait(started, tmp_path / "log", 60)
    assert not process.running(escaped)
    # As the continuation's watch stops a run that is still going.
    started, escaped = _escaping(tmp_path, "exec sleep 300\n")
    assert process.terminate(started.pid, hard=True, token=started.token)
    assert not process.running(escaped)
    started.wait()


def test_only_the_commands_own_processes_carry_its_token(tmp_path):
    started = process.start(["sleep", "300"], tmp_path / "log")
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        assert re.fullmatch(r"[0-9a-f]{16}", started.token)
        assert process.carrying(started.token, float("inf")) == [started.pid]
    finally:
        other.kill()
        other.wait()
        process.terminate(started.pid, hard=True, token=started.token)
        started.wait()


def _a_later_tick_than(ticks: int) -> None:
    """Returns once a process started now starts in a later clock tick than ``ticks`` (probes,
    started one after another until one does: the clock /proc/PID/stat counts in)."""
    for _ in range(100_000):
        probe = subprocess.Popen(["true"])
        later = process.start_ticks(probe.pid) > ticks
        probe.wait()
        if later:
            return
    raise AssertionError(f"no process started after clock tick {ticks}")


def test_a_process_older_than_the_command_is_neither_read_nor_killed_by_the_sweep(tmp_path, monkeypatch):
    """A process started before the command, its variable set by hand: before, the sweep read the
    environment of every process (a read that blocks on one stuck in I/O) and killed it."""
    monkeypatch.setattr(process.secrets, "token_hex", lambda n: "0123456789abcdef")
    variable = {f"{process.TOKEN}0123456789abcdef": "1"}
    older = subprocess.Popen(["sleep", "300"], env={**os.environ, **variable}, start_new_session=True)
    try:
        _a_later_tick_than(process.start_ticks(older.pid))
        started = process.start(["sleep", "300"], tmp_path / "log")
        assert started.token == "0123456789abcdef" and started.start_ticks > process.start_ticks(older.pid)
        assert set(process.carrying(started.token, float("inf"))) == {older.pid, started.pid}
        assert process.carrying(started.token, float("inf"), started.start_ticks) == [started.pid]
        read, holds = [], process._holds
        monkeypatch.setattr(
            process, "_holds", lambda name, needle: read.append(int(name)) or holds(name, needle)
        )
        assert process.terminate(started.pid, hard=True, token=started.token)
        assert started.pid in read and older.pid not in read
        started.wait()
        assert older.poll() is None and process.running(older.pid)
    finally:
        older.kill()
        older.wait()


def test_a_script_that_reaches_production_after_training_is_caught_and_nothing_is_certified(
    trained, tmp_path, options
):
    """The three ways issue 56's tester changed production from the job's own script, each after
    or instead of an honest continuation: before, the first two drills said PASS and certified,
    and the third wrote a checkpoint and tracker outside the drill's scratch."""
    profile, save = continuation_profile(trained, tmp_path, options, 24, INTEGRITY)
    script = profile.drill.continuation.script
    base, shard = script.read_text(), sorted((save / "iter_0000024").glob("*.distcp"))[0]
    escaped, converted = tmp_path / "escaped.pid", tmp_path / "converted"
    # A shard of the promoted checkpoint rewritten in place, its mtime put back, and a child
    # that leaves the run's session.
    rewrite = (
        f"setsid -f bash -c 'echo $$ > {escaped}; exec sleep 300'\ncp -p '{shard}' '{tmp_path}/stamp'\n"
        f"printf 'evil' | dd of='{shard}' bs=1 seek=64 conv=notrunc status=none\n"
        f"touch -r '{tmp_path}/stamp' '{shard}'\nexit $status"
    )
    plant = (
        f"cp -r \"$CKPT_SAVE/iter_0000024\" '{save}/iter_0000028'\n"
        f"echo 28 > '{save}/latest_checkpointed_iteration.txt'\nexit $status"
    )
    convert = (
        f'--ckpt-convert-format torch_dist --ckpt-convert-save "{converted}"\n            --exit-interval'
    )
    cases = {  # each drill reports whatever production holds then: the rewritten shard last
        "a newer iteration planted, the tracker moved": base.replace("exit $status", plant),
        "--ckpt-convert-save outside the scratch": base.replace("--exit-interval", convert, 1),
        "a shard rewritten, touch -r": base.replace("exit $status", rewrite),
    }
    reasons = {}
    for case, text in cases.items():
        script.write_text(text)
        report = run_drill(profile, "shared", continue_steps=4)
        assert not report.ok and not report.certified, (case, report.reason)
        reasons[case] = report
        shutil.rmtree(save / "iter_0000028", ignore_errors=True)
        (save / "latest_checkpointed_iteration.txt").write_text("24\n")
    planted, stopped, rewritten = reasons.values()
    said = [c.detail for c in rewritten.checks if c.name == "save directory"]
    changed = f"iter_0000024/{shard.name} changed (ctime)"
    assert said[0] == f"{save}: the continuation changed the job's save directory: {changed}"
    # Read again against its manifest, the rewritten bytes are named (a record's CRC, first).
    reread = f"{shard}: no longer matches its manifest after the continuation: {shard.name}: "
    assert said[1].startswith(reread)
    assert len(said) == 2
    assert not process.running(int(escaped.read_text()))
    assert planted.reason == (
        f"save directory: {save}: the continuation changed the job's save directory: iter_0000028 appeared, "
        "a new iteration in production while the continuation ran; "
        "latest_checkpointed_iteration.txt went from 24 to 28"
    )
    assert stopped.reason.startswith(
        f"printed arguments: ckpt_convert_save is {converted}, not inside CKPT_SAVE "
    ), stopped.reason
    assert read_manifest(iter_dir(save, 20)).certification is None


def _production_profile(tmp_path: Path, verify: str = ""):
    save = _production(tmp_path / "save")
    path = write_job_profile(tmp_path, save)
    if verify:
        path.write_text(path.read_text().replace("verify: {", "verify: {" + verify + ", "))
    return load_profile(path), save


def test_a_resumable_checkpoint_that_cannot_be_read_again_is_named_with_why(tmp_path):
    """The promoted checkpoint (20) has no manifest, the drilled one (16) a garbled one: neither
    can be re-verified after the run, and each is named. Before: both were passed over without a
    word, and the drill's checks said nothing of production not being read again."""
    profile, save = _production_profile(tmp_path)
    (save / "iter_0000016" / "manifest.json").write_text("{not json")
    found, skipped = _resumable(profile, 16)
    assert found == []
    assert skipped[1] == (
        f"{save}/iter_0000020: the promoted checkpoint will not be re-verified after the continuation: "
        "it has no manifest"
    )
    assert skipped[0].startswith(
        f"{save}/iter_0000016: the drilled checkpoint will not be re-verified after the continuation: "
        "its manifest cannot be read ("
    ), skipped[0]
    assert len(skipped) == 2
    # A pointer that cannot be read: the promoted checkpoint is not known, and that is said.
    (save / "latest_verified_iteration.txt").write_text("twenty")
    found, skipped = _resumable(profile, None)
    assert found == [] and len(skipped) == 1
    assert skipped[0].startswith("the promoted checkpoint will not be re-verified after the continuation: ")


def test_the_reverification_verifies_with_the_profiles_settings(tmp_path, monkeypatch):
    """Before: bare VerifyOptions, with the default engine, threads and hashing, whatever the
    profile's verify section said."""
    profile, save = _production_profile(tmp_path, "threads: 3")
    seen = []

    def verify(directory, options, reference=None):
        seen.append(options)
        raise UsageError("not verified in this test")

    monkeypatch.setattr(continuation, "verify_checkpoint", verify)
    said = continuation._reverified(profile, [(save / "iter_0000020", object())])
    assert said == [
        f"{save}/iter_0000020: cannot be verified again after the continuation: not verified in this test"
    ]
    assert seen[0].threads == 3 and seen[0].engine == profile.verify.engine
    assert seen[0].hashing.segment_bytes == profile.verify.segment_mb << 20
