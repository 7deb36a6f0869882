"""Retention on real checkpoints: exactly the right ones remain."""

import pytest

from tasks.checkpoint.catalog import catalog
from tasks.checkpoint.pins import pin, pinned
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.promote import promote
from tasks.checkpoint.retention import plan_retention, retain
from tasks.checkpoint.state import State
from tests.conftest import exited_process_identity, flip_byte, iter_dir, verify_and_record_here
from tests.test_verify import tensor_data_offset


def remaining(save_dir):
    return sorted(int(p.name[5:]) for p in save_dir.glob("iter_*"))


def test_keep_three_of_six_with_one_failed_and_one_in_progress(save_dir, options):
    broken = iter_dir(save_dir, 12)
    flip_byte(broken / "__0_0.distcp", tensor_data_offset(broken, "__0_0.distcp"))
    (iter_dir(save_dir, 24) / "metadata.json").unlink()  # the newest is still being written
    promote(save_dir, options, 10)
    assert read_pointer(save_dir) == 20
    states = {i.iteration: i.state for i in catalog(save_dir, options)}
    assert states == {4: "valid", 8: "valid", 12: "invalid", 16: "valid", 20: "valid", 24: "in-progress"}

    plan, deleted = retain(save_dir, options, keep_verified=3, lock_timeout_seconds=10)
    # Valid: 4, 8, 16, 20 -> the newest three stay; 12 is failed (kept, reported), 24 in progress.
    assert deleted == [4]
    assert remaining(save_dir) == [8, 12, 16, 20, 24]
    assert plan.invalid == [12]
    assert plan.kept[20] == "promoted" and plan.kept[24].startswith("in-progress")
    assert not list(save_dir.glob(".ckptops-trash-*"))
    # Running again changes nothing.
    assert retain(save_dir, options, keep_verified=3, lock_timeout_seconds=10)[1] == []


def test_nothing_is_deleted_before_a_first_promotion(save_dir, options):
    for it in (4, 8, 12, 16, 20, 24):
        assert verify_and_record_here(iter_dir(save_dir, it), options).state is State.VALID
    plan, deleted = retain(save_dir, options, keep_verified=2, lock_timeout_seconds=10)
    assert deleted == [] and remaining(save_dir) == [4, 8, 12, 16, 20, 24]
    assert set(plan.kept.values()) == {"nothing promoted yet"}


def test_newer_than_promoted_and_pinned_survive(save_dir, options):
    promote(save_dir, options, 10, requested=None)
    promote(save_dir, options, 10, requested=12)  # operator rolled back to 12
    pin(save_dir, 4, "operator", "before the lr change")
    with pinned(save_dir, 8, "drill-test", "restore drill reading"):
        plan, deleted = retain(save_dir, options, keep_verified=2, lock_timeout_seconds=10)
    assert deleted == []
    assert plan.kept[4] == "pinned by operator" and plan.kept[8] == "pinned by drill-test"
    assert plan.kept[16] == plan.kept[20] == plan.kept[24] == "newer than the promoted checkpoint"
    # Once the drill's lease ends, 8 may go; the operator's pin still holds 4.
    _, deleted = retain(save_dir, options, keep_verified=2, lock_timeout_seconds=10)
    assert deleted == [8] and remaining(save_dir) == [4, 12, 16, 20, 24]


def test_plan_is_a_pure_function_of_the_catalog(save_dir, options):
    promote(save_dir, options, 10)
    infos = catalog(save_dir, options)
    plan = plan_retention(infos, 24, 3)
    assert plan.delete == [4, 8, 12]
    assert remaining(save_dir) == [4, 8, 12, 16, 20, 24]


def test_a_lease_whose_reader_is_gone_protects_nothing(save_dir, options):
    """A drill or an archive copy killed with SIGKILL never unpins: its lease names its process,
    and once that is gone retention removes the lease and may delete the checkpoint."""
    import json

    promote(save_dir, options, 30)
    pin(save_dir, 4, "operator", "keep it")
    lease = pin(save_dir, 8, "drill-4242", "restore drill reading", lease=True)
    record = json.loads(lease.read_text())
    record["lease"] = exited_process_identity()
    lease.write_text(json.dumps(record))
    infos = {i.iteration: i for i in catalog(save_dir, options)}
    assert infos[8].pins == [] and infos[8].expired_pins[0].startswith("drill-4242 (lease expired: process ")
    assert infos[4].pins == ["operator"]
    plan, deleted = retain(save_dir, options, 3, 30)
    assert plan.expired_leases[0].startswith("iter_0000008@drill-4242 (lease expired: process ")
    assert deleted == [8, 12] and not lease.exists()
    assert remaining(save_dir) == [4, 16, 20, 24]  # the operator's pin still holds 4
    with pinned(save_dir, 16, "drill-live", "reading"):  # a live reader's lease protects
        assert retain(save_dir, options, 2, 30)[0].kept[16].startswith("pinned by drill-live")


def test_only_trash_ckptops_recorded_is_purged(tmp_path, monkeypatch, caplog):
    """Before: ``purge_trash`` deleted every ``.ckptops-trash-*`` folder, a user's included, and
    said nothing. Now a delete a crash cut short is finished, and nothing else is touched."""
    from tasks.storage import local

    save = tmp_path / "save"
    (save / "iter_0000004").mkdir(parents=True)
    (save / "iter_0000004" / "shard").write_text("x")
    users = save / ".ckptops-trash-x"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    # A delete killed after its rename: the trash folder stays, recorded.
    with monkeypatch.context() as crash, pytest.raises(KeyboardInterrupt):
        crash.setattr(local.shutil, "rmtree", _killed)
        local.remove_tree(save / "iter_0000004")
    (ours,) = [p for p in save.glob(".ckptops-trash-iter_0000004-*")]
    # A folder made later at the name of a trash ckptops finished deleting (its inode may well
    # be the deleted one's): not ours.
    local.remove_tree(_made(save / "iter_0000008"))
    (name,) = {line["trash"] for line in _record(save) if "iter_0000008" in line["trash"]}
    swapped = _made(save / name)

    with caplog.at_level("WARNING"):
        left = local.purge_trash(save)
    assert not ours.exists()
    assert left == sorted([users, swapped]) and (users / "notes.txt").read_text() == "mine"
    record = save / ".ckptops-trash.jsonl"
    assert sorted(r.getMessage() for r in caplog.records) == [
        f"{path}: named like ckptops's trash, but no deletion of ckptops's recorded it in {record}; "
        "left alone"
        for path in sorted([users, swapped])
    ]
    # The record keeps only trash still there that it made (none): it is gone.
    assert not (save / local.TRASH_RECORD).exists()


def _killed(path):
    raise KeyboardInterrupt  # the process stopped mid-delete


def _made(path):
    path.mkdir()
    return path


def _record(save) -> list[dict]:
    import json

    from tasks.storage.local import TRASH_RECORD

    return [json.loads(line) for line in (save / TRASH_RECORD).read_text().splitlines()]


def test_a_trash_record_another_account_could_write_proves_nothing(tmp_path, caplog):
    """A record line forged by another account must not turn a user's folder into our trash."""
    import json
    import os

    from tasks.storage import local

    save = tmp_path / "save"
    users = save / ".ckptops-trash-x"
    users.mkdir(parents=True)
    found = os.stat(users)
    record = save / local.TRASH_RECORD
    record.write_text(json.dumps({"trash": users.name, "device": found.st_dev, "inode": found.st_ino}) + "\n")
    os.chown(record, 65534, 65534)
    with caplog.at_level("WARNING"):
        assert local.purge_trash(save) == [users]
    assert users.is_dir()
    assert any(f"{record}: owned by another account than ckptops's" in r.getMessage() for r in caplog.records)


def test_ckptops_own_trash_record_is_trusted_in_a_save_directory_of_the_jobs_user(
    tmp_path, monkeypatch, caplog
):
    """Before: the record was trusted only in a folder of ckptops's account, and the save
    directory is normally the job user's: a delete a crash cut short was never finished. Now the
    record is trusted by the file alone (ckptops's, 0600, one link); any other still proves
    nothing."""
    import os
    import shutil

    from tasks.storage import local

    save = tmp_path / "save"
    save.mkdir()
    os.chown(save, 65534, 65534)  # the job's user's save directory

    def crashed_delete():
        (save / "iter_0000004").mkdir()
        with monkeypatch.context() as crash, pytest.raises(KeyboardInterrupt):
            crash.setattr(local.shutil, "rmtree", _killed)
            local.remove_tree(save / "iter_0000004")
        (trash,) = save.glob(".ckptops-trash-iter_0000004-*")
        return trash

    ours = crashed_delete()
    assert local.purge_trash(save) == [] and not ours.exists()
    assert not (save / local.TRASH_RECORD).exists()
    record = save / local.TRASH_RECORD
    for spoil, why in (
        (lambda: os.chmod(record, 0o644), "not private to its owner (mode other than 0600)"),
        (lambda: os.chown(record, 65534, 65534), "owned by another account than ckptops's"),
    ):
        trash = crashed_delete()
        spoil()
        with caplog.at_level("WARNING"):
            assert local.purge_trash(save) == [trash]
        assert trash.is_dir()
        assert any(r.getMessage().startswith(f"{record}: {why}") for r in caplog.records)
        record.unlink()
        shutil.rmtree(trash)
