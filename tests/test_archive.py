"""The archive tier against a real S3-compatible server (moto, over HTTP, with s3fs) and against
a local directory, and restore drills from it with the real load."""

import base64
import json
import os
import re
import socket
import subprocess
import sys
import uuid

import pytest
import xxhash

from tasks.archive.copy import archive_checkpoint
from tasks.archive.entries import archived_manifest, committed_iterations, newest_committed
from tasks.archive.history import copies
from tasks.archive.retention import apply_archive_retention
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.pins import expired_leases
from tasks.checkpoint.promote import promote
from tasks.profile import load_profile
from tasks.restore.drill import run_drill
from tasks.restore.history import read_drills
from tasks.storage.archive import ArchiveStore
from tests.conftest import ROOT, iter_dir, s3_bucket, write_job_profile
from tests.test_cli import ckptops_here


@pytest.fixture(params=["local", "s3"])
def archived_profile(request, save_dir, tmp_path, options):
    """A promoted job and a profile whose archive is a local directory or a bucket on moto."""
    promote(save_dir, options, 30)
    if request.param == "local":
        path = write_job_profile(tmp_path, save_dir, str(tmp_path / "archive"))
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = s3_bucket(endpoint, f"archive-{uuid.uuid4().hex[:12]}")
        path = write_job_profile(tmp_path, save_dir, f"s3://{bucket}/checkpoints", endpoint)
    return load_profile(path)


def store_of(profile) -> ArchiveStore:
    return ArchiveStore.from_settings(profile.archive)


def test_archive_commits_manifest_last_and_records_status(archived_profile, save_dir):
    result = archive_checkpoint(save_dir, archived_profile)
    assert result.committed and result.iteration == 24
    store = store_of(archived_profile)
    assert committed_iterations(store, "test-job") == [24] and newest_committed(store, "test-job") == 24
    manifest = read_manifest(iter_dir(save_dir, 24))
    for entry in manifest.files:
        assert store.hash_object(f"test-job/iter_0000024/{entry.path}", manifest.hashing) == (
            entry.size,
            entry.hash,
        )
    # The copy is the archive's own record; the shared-store manifest stays the verifier's.
    (copy,) = copies(save_dir)
    assert copy["iteration"] == 24 and copy["url"] == result.location and "read back" in copy["verified"]
    assert manifest.archive is None
    again = archive_checkpoint(save_dir, archived_profile)
    assert not again.committed and again.message == "iteration 24 is already archived"


def test_killed_upload_is_not_committed_and_the_next_run_completes_it(archived_profile, save_dir):
    child = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "helpers" / "archive_child.py"), str(archived_profile.source)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this tree's code, whatever is installed
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert child.returncode == -9, child.stderr
    # Its lease stays behind but names a process that is gone: it protects nothing.
    ((lease, why),) = expired_leases(save_dir)
    assert lease.holder.startswith("archive-") and why.startswith("lease expired: process ")
    store = store_of(archived_profile)
    assert committed_iterations(store, "test-job") == []
    assert store.listdir("test-job/iter_0000024")  # objects are there, but no manifest: not an entry
    report = run_drill(archived_profile, "archive")
    assert not report.ok and "no committed archive entry" in report.reason
    result = archive_checkpoint(save_dir, archived_profile)
    assert result.committed and result.reused_bytes > 0
    assert committed_iterations(store, "test-job") == [24]


def test_drill_from_archive_restores_verifies_and_loads(archived_profile, save_dir):
    archive_checkpoint(save_dir, archived_profile)
    report = run_drill(archived_profile, "archive")
    assert report.ok, report.reason
    assert [p.name for p in report.phases] == ["download", "verify", "load"]
    assert {c.name for c in report.checks if c.ok} >= {
        "iteration",
        "consumed samples",
        "scheduler",
        "tensors",
    }
    assert report.iteration == 24 and report.location.endswith("test-job/iter_0000024")
    assert list((archived_profile.drill.scratch_dir).iterdir()) == []
    assert read_drills(save_dir)[-1]["source"] == "archive"


def _corrupt_object(profile, key: str) -> None:
    store = store_of(profile)
    data = bytearray(store.read(key))
    data[len(data) // 2] ^= 0x01
    store.write(key, bytes(data))


def test_corrupted_archived_object_fails_the_drill_naming_it(archived_profile, save_dir):
    archive_checkpoint(save_dir, archived_profile)
    _corrupt_object(archived_profile, "test-job/iter_0000024/__1_0.distcp")
    report = run_drill(archived_profile, "archive")
    assert not report.ok
    assert report.reason.startswith(f"{archived_profile.archive.url}/test-job/iter_0000024/__1_0.distcp: ")
    assert "failed verification" in report.reason
    assert list(archived_profile.drill.scratch_dir.iterdir()) == []


@pytest.mark.parametrize(
    "order, kept, named", [((16, 20, 24), [20, 24], 24), ((20, 24, 16), [16, 24], 16)]
)  # rolled back to 16
def test_archive_retention_keeps_the_newest_commits_and_never_the_only_one(
    save_dir, tmp_path, options, order, kept, named
):
    """Retention goes by commit time: after a rollback the older iteration's fresh copy stays."""
    profile = load_profile(write_job_profile(tmp_path, save_dir, str(tmp_path / "archive"), keep=2))
    store = store_of(profile)
    for iteration in order:
        promote(save_dir, options, 30, requested=iteration)
        archive_checkpoint(save_dir, profile, force=True)
    assert committed_iterations(store, "test-job") == kept and newest_committed(store, "test-job") == named
    assert store.listdir("test-job") == [f"iter_{i:07d}" for i in kept] + ["latest_committed_iteration.txt"]
    assert apply_archive_retention(store, "test-job", keep=2) == []


def test_an_unreadable_archived_manifest_does_not_stop_the_archive(save_dir, tmp_path, options):
    """A bad old entry is left for a human (named, never deleted); newer copies still commit."""
    profile = load_profile(write_job_profile(tmp_path, save_dir, str(tmp_path / "archive"), keep=2))
    store = store_of(profile)
    promote(save_dir, options, 30, requested=16)
    assert archive_checkpoint(save_dir, profile, force=True).committed
    store.write("test-job/iter_0000016/manifest.json", b"")
    for iteration in (20, 24):
        promote(save_dir, options, 30, requested=iteration)
        result = archive_checkpoint(save_dir, profile, force=True)
        assert (
            result.committed
            and "unreadable archived manifests kept for inspection: iterations 16" in result.message
        )
    assert committed_iterations(store, "test-job") == [16, 20, 24]
    promote(save_dir, options, 30, requested=16)  # rolled back to the iteration with the bad entry
    result = archive_checkpoint(save_dir, profile)
    assert not result.committed and "its archived manifest is unreadable" in result.message
    assert result.message.endswith("kept for inspection: --force replaces it")
    assert store.read("test-job/iter_0000016/manifest.json") == b""  # left as found, for a human


def test_force_replaces_an_archived_entry_whose_manifest_is_unreadable(archived_profile, save_dir):
    """``archive --force`` copies the promoted save afresh into its entry whose manifest cannot
    be read (it kept it, never overwritten, whatever the operator asked), reusing the objects
    found whole; without ``--force`` the entry is kept for inspection and the run says how."""
    assert archive_checkpoint(save_dir, archived_profile).committed
    store = store_of(archived_profile)
    key = "test-job/iter_0000024/manifest.json"
    store.write(key, b"{torn")
    kept = archive_checkpoint(save_dir, archived_profile)
    assert not kept.committed and kept.message.endswith("kept for inspection: --force replaces it")
    assert store.read(key) == b"{torn"
    done = ckptops_here("archive", "--force", "-p", archived_profile.source)
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith("iteration 24 -> ")
    assert f"{archived_profile.archive.url}/{key}: " in done.stdout
    assert "(unreadable archived manifest)): replaced (--force)" in done.stdout
    assert "reused 0.0 MB" not in done.stdout  # the objects already there whole were not sent again
    archived = archived_manifest(store, "test-job", 24)
    assert archived.files == read_manifest(iter_dir(save_dir, 24)).files and archived.archive["verified"]
    assert committed_iterations(store, "test-job") == [24]
    assert archive_checkpoint(save_dir, archived_profile).message == "iteration 24 is already archived"


def test_a_resaved_iteration_never_overwrites_its_committed_copy(save_dir, tmp_path, options):
    """The same iteration with other bytes: the committed copy may be the only one, so it stays."""
    profile = load_profile(write_job_profile(tmp_path, save_dir, str(tmp_path / "archive")))
    promote(save_dir, options, 30)
    assert archive_checkpoint(save_dir, profile).committed
    store = store_of(profile)
    key = "test-job/iter_0000024/manifest.json"
    archived = json.loads(store.read(key))
    archived["files"][0]["hash"] = "0" * 32  # the archive now holds "another save" of iteration 24
    store.write(key, json.dumps(archived).encode())
    objects = {
        name: store.read(f"test-job/iter_0000024/{name}") for name in store.listdir("test-job/iter_0000024")
    }
    result = archive_checkpoint(save_dir, profile, force=True)
    assert not result.committed and "already archived from an earlier save" in result.message
    assert {
        name: store.read(f"test-job/iter_0000024/{name}") for name in store.listdir("test-job/iter_0000024")
    } == objects


def test_multipart_upload_of_large_files(medium_save_dir, tmp_path, s3_endpoint, options):
    """Files larger than the part size go up in several parts and still read back exactly."""
    promote(medium_save_dir, options, 30)
    bucket = s3_bucket(s3_endpoint, f"multipart-{uuid.uuid4().hex[:12]}")
    profile = load_profile(
        write_job_profile(
            tmp_path,
            medium_save_dir,
            f"s3://{bucket}/c",
            s3_endpoint,
            extra_archive=", multipart_chunk_mb: 5",
        )
    )
    manifest = read_manifest(iter_dir(medium_save_dir, 4))
    assert max(f.size for f in manifest.files) > 2 * (5 << 20)
    assert archive_checkpoint(medium_save_dir, profile).committed
    import boto3

    head = boto3.client("s3", endpoint_url=s3_endpoint).head_object(
        Bucket=bucket, Key="c/test-job/iter_0000004/__0_0.distcp"
    )
    assert re.search(r"-[2-9]$", head["ETag"].strip('"'))  # a multipart object's ETag counts its parts
    # Its full-object CRC64NVME, as the store computed it from the parts it got (moto does), is
    # the one computed from the local bytes that hashed as the manifest.
    from awscrt.checksums import crc64nvme

    checked = boto3.client("s3", endpoint_url=s3_endpoint).head_object(
        Bucket=bucket, Key="c/test-job/iter_0000004/__0_0.distcp", ChecksumMode="ENABLED"
    )
    local = (iter_dir(medium_save_dir, 4) / "__0_0.distcp").read_bytes()
    assert checked["ChecksumType"] == "FULL_OBJECT"
    assert checked["ChecksumCRC64NVME"] == base64.b64encode(crc64nvme(local).to_bytes(8, "big")).decode()
    assert copies(medium_save_dir)[-1]["crc64nvme"]["__0_0.distcp"] == checked["ChecksumCRC64NVME"]
    assert run_drill(profile, "archive").ok


def test_unreachable_store_fails_the_drill_after_bounded_retries(save_dir, tmp_path, options):
    """A store that accepts connections and never answers: the drill must fail, not hang."""
    promote(save_dir, options, 30)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections complete in the backlog; nothing ever answers
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    path = write_job_profile(
        tmp_path,
        save_dir,
        "s3://nobody/here",
        endpoint,
        extra_archive=", read_timeout_seconds: 1, connect_timeout_seconds: 1, max_attempts: 2",
    )
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        result = subprocess.run(
            [
                str(ROOT / ".venv" / "bin" / "ckptops"),
                "drill",
                "--source",
                "archive",
                "--profile",
                str(path),
                "--json",
            ],
            cwd=ROOT,
            env=env,
            timeout=240,
            capture_output=True,
            text=True,
        )
    finally:
        silent.close()
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert not report["ok"] and report["reason"].startswith("s3://nobody/here/test-job: list failed")
    assert "Timeout" in report["reason"] or "timed out" in report["reason"]


def test_archive_never_modifies_the_source(archived_profile, save_dir):
    directory = iter_dir(save_dir, 24)
    before = {
        p.name: xxhash.xxh3_128(p.read_bytes()).hexdigest()
        for p in directory.iterdir()
        if p.name != "manifest.json"
    }
    archive_checkpoint(save_dir, archived_profile)
    run_drill(archived_profile, "shared")
    after = {
        p.name: xxhash.xxh3_128(p.read_bytes()).hexdigest()
        for p in directory.iterdir()
        if p.name != "manifest.json"
    }
    assert after == before
    assert not list((save_dir / ".ckptops-pins").iterdir())  # the drill's and the copy's leases are gone


def test_a_committed_entry_whose_objects_vanished_is_copied_again(archived_profile, save_dir):
    profile = archived_profile
    assert archive_checkpoint(save_dir, profile, force=True).committed
    store_of(profile).remove("test-job/iter_0000024/__1_0.distcp")  # a lifecycle rule, a hand
    again = archive_checkpoint(save_dir, profile, force=True)
    assert again.committed and again.uploaded_bytes > 0
    assert (
        "the committed copy had lost 1 of its objects (__1_0.distcp missing): uncommitted and copied again"
        in (again.message)
    )
    assert run_drill(profile, "archive").ok
    assert archive_checkpoint(save_dir, profile, force=True).message == "iteration 24 is already archived"
