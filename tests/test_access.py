"""Access: what others can write is never promoted, what ckptops writes gets 0644 (0600 for a
secret) and its directory's group, and a key others can read is refused.

The tests run as root, who can write anything: they set modes and owners (root may chown to any
uid) and check that those are refused, not that a write is denied."""

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from tasks.checkpoint.access import Exposed, refuse_readable_by_others, unsafe_for_promotion
from tasks.checkpoint.layout import HISTORY, MANIFEST, MEGATRON_TRACKER, POINTER
from tasks.checkpoint.pointer import PROMOTIONS, read_hold, read_pointer, write_pointer
from tasks.checkpoint.promote import promote
from tasks.checkpoint.state import VerifyOptions
from tasks.checkpoint.verdicts import VERDICTS
from tasks.errors import UsageError
from tasks.storage.local import append_jsonl, atomic_write
from tests.conftest import iter_dir, verify_and_record_here
from tests.test_cli import ckptops_here

OTHER_UID, OTHER_GID = 54321, 54322  # nobody on this host: root may still chown to them


@pytest.fixture
def umask():
    """Set a umask for the test, restore the old one after."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o002, 0o077])
def test_written_files_get_0644_or_0600_and_the_directory_group_whatever_the_umask(tmp_path, umask, mask):
    """A umask of 002 (common on clusters) must not leave a manifest or the pointer group-writable,
    and 077 must not hide them from the project group that reads them."""
    umask(mask)
    os.chown(tmp_path, -1, OTHER_GID)
    (tmp_path / "old").write_bytes(b"x")
    os.chmod(tmp_path / "old", 0o666)
    atomic_write(tmp_path / "old", b"replaced")
    atomic_write(tmp_path / "key", b"secret", secret=True)
    (tmp_path / "log").mkdir()
    os.chown(tmp_path / "log", -1, OTHER_GID)
    append_jsonl(tmp_path / "log" / "new.jsonl", {"a": 1})
    for name, mode in [("old", 0o644), ("key", 0o600), ("log/new.jsonl", 0o644)]:
        st = os.stat(tmp_path / name)
        assert (oct(stat.S_IMODE(st.st_mode)), st.st_gid) == (oct(mode), OTHER_GID), name
    assert (tmp_path / "old").read_bytes() == b"replaced"
    # An existing log is appended to as it is: its mode is its owner's business.
    os.chmod(tmp_path / "log" / "new.jsonl", 0o640)
    append_jsonl(tmp_path / "log" / "new.jsonl", {"a": 2})
    assert _mode(tmp_path / "log" / "new.jsonl") == 0o640


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o601])
def test_a_key_others_can_read_or_write_is_refused(tmp_path, mode):
    key = tmp_path / "signing.key"
    key.write_bytes(b"-----BEGIN PRIVATE KEY-----\n")
    os.chmod(key, mode)
    with pytest.raises(Exposed) as refused:
        refuse_readable_by_others(key, "the signing key")
    line = str(refused.value)
    assert line.startswith(f"{key}: the signing key refused, readable or writable by others")
    assert "UNPROTECTED PRIVATE KEY FILE" in line and stat.filemode(0o100000 | mode) in line
    assert oct(mode) in line and "\n" not in line and refused.value.exit_code == 2


def test_a_private_key_passes_and_another_users_or_a_directory_does_not(tmp_path):
    key = tmp_path / "signing.key"
    key.write_bytes(b"k")
    for mode in (0o600, 0o400):
        os.chmod(key, mode)
        assert refuse_readable_by_others(key, "the signing key").st_size == 1
    os.chown(key, OTHER_UID, -1)
    with pytest.raises(
        Exposed, match=f"{key}: the signing key refused, owned by another user.*uid {OTHER_UID}"
    ):
        refuse_readable_by_others(key, "the signing key")
    os.chmod(tmp_path, 0o700)
    with pytest.raises(Exposed, match="not a regular file"):
        refuse_readable_by_others(tmp_path, "the signing key")
    with pytest.raises(UsageError, match="the signing key is not there"):
        refuse_readable_by_others(tmp_path / "missing.key", "the signing key")


DATA_FILES = ["__0_0.distcp", ".metadata", "metadata.json", "common.pt"]  # what a resume reads


def _save(tmp_path: Path) -> Path:
    """A save directory with every path promotion trusts (no real checkpoint: only modes count)."""
    save = tmp_path / "save"
    (save / "iter_0000008").mkdir(parents=True)
    (save / HISTORY).mkdir()
    os.chmod(save, 0o755)
    os.chmod(save / "iter_0000008", 0o755)
    data = [save / "iter_0000008" / name for name in [MANIFEST, *DATA_FILES]]
    for path in (save / POINTER, save / MEGATRON_TRACKER, save / HISTORY / VERDICTS, *data):
        path.write_text("8\n")
        os.chmod(path, 0o644)
    return save


PATHS = {
    "save directory": "",
    "checkpoint": "iter_0000008",
    "manifest": f"iter_0000008/{MANIFEST}",
    "pointer": POINTER,
    "tracker": MEGATRON_TRACKER,
    "verdict log": f"{HISTORY}/{VERDICTS}",
    **{name: f"iter_0000008/{name}" for name in DATA_FILES},
}


@pytest.mark.parametrize("which", PATHS)
@pytest.mark.parametrize(
    "change, why",
    [
        (lambda p: os.chmod(p, os.stat(p).st_mode | 0o002), "world-writable"),
        (lambda p: os.chmod(p, os.stat(p).st_mode | 0o020), "group-writable"),
        (lambda p: os.chown(p, OTHER_UID, -1), "owned by another user than the job's"),
    ],
    ids=["o+w", "g+w", "chown"],
)
def test_each_path_others_can_write_is_named_with_its_mode_and_owner(tmp_path, which, change, why):
    save = _save(tmp_path)
    assert unsafe_for_promotion(save, 8) == []
    path = save / PATHS[which]
    change(path)
    # A job's user named apart from the save directory's owner, so a chown of that is refused too.
    [line] = unsafe_for_promotion(save, 8, job_user=str(OTHER_UID + 1))
    st = os.stat(path)
    owner = "root (uid 0)" if st.st_uid == 0 else f"uid {OTHER_UID}"
    mode = f"{stat.filemode(st.st_mode)} ({oct(stat.S_IMODE(st.st_mode))}), owner {owner}, group "
    assert line.startswith(f"{path.resolve()}: {why}") and mode in line and "\n" not in line


def test_group_write_is_trusted_only_when_the_profile_says_and_world_write_never(tmp_path):
    save = _save(tmp_path)
    os.chmod(save, 0o775)
    os.chmod(save / POINTER, 0o664)
    assert len(unsafe_for_promotion(save, 8)) == 2
    assert unsafe_for_promotion(save, 8, allow_group_write=True) == []
    os.chmod(save / POINTER, 0o666)
    assert [line.split(":")[:2] for line in unsafe_for_promotion(save, 8, allow_group_write=True)] == [
        [str(save / POINTER), " world-writable"]
    ]


def test_the_jobs_user_root_and_a_symlink(tmp_path):
    """Root-owned files are trusted (root writes anything anyway); the job's user is the save
    directory's owner unless the profile names one; a symlink is never taken for a file."""
    save = _save(tmp_path)
    os.chown(save, OTHER_UID, -1)  # the job's user is now OTHER_UID; root's files stay trusted
    os.chown(save / POINTER, OTHER_UID, -1)
    assert unsafe_for_promotion(save, 8) == []
    lines = unsafe_for_promotion(save, 8, job_user=str(OTHER_UID + 1))
    assert [line.split(": ")[:2] for line in lines] == [
        [str(save), "owned by another user than the job's"],
        [str(save / POINTER), "owned by another user than the job's"],
    ]
    assert all(f"owner uid {OTHER_UID}," in line for line in lines)
    with pytest.raises(UsageError, match="job.user: no such user 'no-such-user-here'"):
        unsafe_for_promotion(save, 8, job_user="no-such-user-here")
    (save / MEGATRON_TRACKER).unlink()
    (save / MEGATRON_TRACKER).symlink_to(save / POINTER)
    [line] = unsafe_for_promotion(save, 8)
    assert line.startswith(f"{save / MEGATRON_TRACKER}: a symlink")
    # Inside the checkpoint: a shard that is a symlink is named; a file no resume reads is not.
    shard = save / "iter_0000008" / DATA_FILES[0]
    shard.unlink()
    shard.symlink_to(save / POINTER)
    stray = save / "iter_0000008" / "notes.txt"
    stray.write_text("x")
    os.chmod(stray, 0o666)
    symlink = "a symlink (anybody who can write its target, or the target's directory, controls it)"
    assert [line.split(": ")[:2] for line in unsafe_for_promotion(save, 8)] == [
        [str(save / MEGATRON_TRACKER), symlink],
        [str(shard), symlink],
    ]


def test_the_profile_names_the_jobs_user_and_the_trusted_group(tmp_path):
    from tasks.profile import load_profile

    profile = tmp_path / "p.yaml"
    profile.write_text(
        f"job: {{name: x, save_dir: '{tmp_path}', user: alice}}\nverify: {{allow_group_write: true}}\n"
    )
    options = VerifyOptions.from_profile(load_profile(profile))
    assert (options.job_user, options.allow_group_write) == ("alice", True)
    # Another save directory is not the job's: its owner is its user, not the profile's.
    assert VerifyOptions.from_profile(load_profile(profile), tmp_path / "other").job_user is None
    assert VerifyOptions(job="x").allow_group_write is False


@pytest.mark.parametrize(
    "which, change",
    [
        ("", lambda p: os.chmod(p, 0o777)),
        (f"iter_0000024/{MANIFEST}", lambda p: os.chown(p, OTHER_UID, -1)),
        (POINTER, lambda p: os.chmod(p, 0o664)),
        ("iter_0000024/__1_0.distcp", lambda p: os.chmod(p, 0o666)),
        ("iter_0000024/__0_0.distcp", lambda p: os.chown(p, OTHER_UID, -1)),
        ("iter_0000024/.metadata", lambda p: os.chmod(p, 0o666)),
        ("iter_0000024/metadata.json", lambda p: os.chmod(p, 0o664)),
    ],
    ids=[
        "save-dir-o+w",
        "manifest-chown",
        "pointer-g+w",
        "shard-0666",
        "shard-chown",
        "dcp-metadata-0666",
        "metadata-json-g+w",
    ],
)
def test_an_exposed_save_is_not_promoted_and_nothing_changes(save_dir, options, which, change):
    """Nothing moves: not the pointer, not the hold, not the log; the run is not ok and says
    why, one line per path; once the mode is put right the same run promotes."""
    promote(save_dir, options, 10, requested=8)
    verify_and_record_here(iter_dir(save_dir, 24), options)  # its manifest exists to be exposed
    log = (save_dir / HISTORY / PROMOTIONS).read_bytes()
    path = save_dir / which
    before = os.stat(path)
    change(path)
    report = promote(save_dir, options, 10)
    assert read_pointer(save_dir) == 8 and report.current == 8 and not report.changed
    assert read_hold(save_dir) is None and (save_dir / HISTORY / PROMOTIONS).read_bytes() == log
    assert not report.ok and report.message.startswith("iter_0000024 not promoted: others can write 1")
    [line] = report.refused
    assert line.startswith(f"{path.resolve()}: ") and stat.filemode(os.stat(path).st_mode) in line
    assert report.problems() == [f"not promoted: {line}"]
    os.chmod(path, stat.S_IMODE(before.st_mode))
    os.chown(path, before.st_uid, before.st_gid)
    again = promote(save_dir, options, 10)
    assert again.ok and again.current == 24 and read_pointer(save_dir) == 24


def test_ckptops_promote_exits_1_with_one_line_per_exposed_path(save_dir):
    write_pointer(save_dir, 4)
    os.chmod(save_dir, 0o777)
    os.chmod(save_dir / POINTER, 0o666)
    result = ckptops_here("promote", save_dir, "--json")
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert [line.split(": ")[:3] for line in lines] == [
        ["ckptops", "not promoted", str(save_dir)],
        ["ckptops", "not promoted", str(save_dir / POINTER)],
    ]
    assert all("world-writable" in line and "owner root (uid 0)" in line for line in lines)
    data = json.loads(result.stdout)
    assert data["current"] == 4 and len(data["refused"]) == 2 and read_pointer(save_dir) == 4


def test_the_flow_fails_naming_the_path_and_deletes_nothing(prefect_api, save_dir, tmp_path):
    """verify-and-promote on a world-writable save directory: the pointer stays, and retention
    (which would delete 4, 8 and 12 behind the pointer at 24) deletes nothing; the run fails
    naming the directory."""
    from prefect.artifacts import Artifact

    from flows.verify_and_promote import verify_and_promote
    from tasks.profile import load_profile
    from tests.test_flow import write_profile

    profile = write_profile(tmp_path, save_dir, "flow-exposed")
    promote(save_dir, VerifyOptions.from_profile(load_profile(profile)), 10)
    os.chmod(save_dir, 0o777)
    state = verify_and_promote(profile=profile, return_state=True)
    assert state.is_failed() and state.message.startswith(
        f"not promoted: {save_dir.resolve()}: world-writable"
    )
    assert read_pointer(save_dir) == 24 and len(list(save_dir.glob("iter_*"))) == 6
    summary = Artifact.get("verify-summary-flow-exposed").data
    assert f"- **not promoted**: `{save_dir.resolve()}: world-writable" in summary


def test_a_shard_swapped_for_a_symlink_after_verification_is_not_promoted(save_dir, options, tmp_path):
    """Promotion reads the shards' modes from the listing it shares with the catalog: a shard
    replaced by a link to an identical copy elsewhere (same bytes, so the manifest still fits)
    is named as a symlink, and nothing moves."""
    promote(save_dir, options, 10, requested=8)
    verify_and_record_here(iter_dir(save_dir, 24), options)
    shard = iter_dir(save_dir, 24) / "__1_0.distcp"
    elsewhere = shutil.copy2(shard, tmp_path / "elsewhere.distcp")
    shard.unlink()
    shard.symlink_to(elsewhere)
    report = promote(save_dir, options, 10)
    assert read_pointer(save_dir) == 8 and not report.ok
    [line] = report.refused
    assert line.startswith(f"{save_dir.resolve() / shard.parent.name / shard.name}: a symlink"), line
