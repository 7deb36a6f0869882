"""The archive checked by the store (full-object CRC64NVME, a sampled read-back) and protected at
rest (SSE-KMS with bucket keys, Object Lock, a retention period), against the real S3-compatible
server the archive tests start (moto in server mode, over HTTP)."""

import base64
import dataclasses
import json
import uuid
from datetime import UTC, datetime, timedelta

import boto3
import pytest
from awscrt.checksums import crc64nvme
from botocore.exceptions import ClientError

from tasks.archive import retention
from tasks.archive.check import reads_back
from tasks.archive.copy import archive_checkpoint
from tasks.archive.entries import committed_iterations
from tasks.archive.history import copies, copies_path, status_lines
from tasks.archive.retention import apply_archive_retention
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.promote import promote
from tasks.errors import UsageError
from tasks.profile import load_profile
from tasks.storage.archive import ArchiveStore, ArchiveUnavailable, SourceChanged
from tasks.storage.local import append_jsonl
from tests.conftest import flip_byte, iter_dir, s3_bucket, write_job_profile

JOB = "test-job"


def crc_of(data: bytes) -> str:
    return base64.b64encode(crc64nvme(data).to_bytes(8, "big")).decode()


def s3_profile(tmp_path, save_dir, endpoint, bucket, extra="", keep=3):
    return load_profile(
        write_job_profile(tmp_path, save_dir, f"s3://{bucket}/c", endpoint, keep=keep, extra_archive=extra)
    )


def head(endpoint, bucket, key):
    return boto3.client("s3", endpoint_url=endpoint).head_object(
        Bucket=bucket, Key=f"c/{key}", ChecksumMode="ENABLED"
    )


def archive_counting(save_dir, profile, **kwargs):
    counted = []
    result = archive_checkpoint(save_dir, profile, progress=counted.append, **kwargs)
    return result, sum(counted)


def test_the_read_back_sample_rotates_by_the_count_of_copies(tmp_path):
    """1 in 7 by default: the 1st, 8th and 15th copy are read back; 0 never, 1 always; a local
    directory always."""
    save = tmp_path / "save"
    s3 = load_profile(write_job_profile(tmp_path, save, "s3://b/c", "http://127.0.0.1:9")).archive
    never = s3.model_copy(update={"readback_fraction": 0.0})
    always = s3.model_copy(update={"readback_fraction": 1.0})
    local = load_profile(write_job_profile(tmp_path, save, str(tmp_path / "archive"))).archive
    seen = {"default": [], "never": [], "always": [], "local": []}
    for n in range(15):
        for name, settings in (("default", s3), ("never", never), ("always", always), ("local", local)):
            seen[name].append(reads_back(save, settings))
        append_jsonl(copies_path(save), {"iteration": n})
    assert [i for i, r in enumerate(seen["default"]) if r] == [0, 7, 14]
    assert not any(seen["never"]) and all(seen["always"]) and all(seen["local"])


def test_a_copy_is_checked_by_the_stores_crc64nvme_and_only_the_sample_is_read_back(
    save_dir, tmp_path, options, s3_endpoint
):
    bucket = s3_bucket(s3_endpoint, f"crc-{uuid.uuid4().hex[:12]}")
    profile = s3_profile(tmp_path, save_dir, s3_endpoint, bucket)
    sizes = {}
    for iteration in (20, 24):
        promote(save_dir, options, 30, requested=iteration)
        sizes[iteration] = sum(f.size for f in read_manifest(iter_dir(save_dir, iteration)).files)
    promote(save_dir, options, 30, requested=20)
    first, first_bytes = archive_counting(save_dir, profile)
    promote(save_dir, options, 30, requested=24)
    second, second_bytes = archive_counting(save_dir, profile, force=True)
    assert first.committed and second.committed
    # Progress counts each byte uploaded and each byte read back: the sampled first copy is read
    # back, the second is not (nothing of it is downloaded).
    assert first_bytes == 2 * sizes[20] and second_bytes == sizes[24]
    logged = copies(save_dir)
    assert [c["read_back"] for c in logged] == [True, False]
    assert "not read back" in logged[1]["verified"] and "CRC64NVME" in logged[1]["verified"]
    for iteration, entry in zip((20, 24), logged, strict=True):
        manifest = read_manifest(iter_dir(save_dir, iteration))
        assert set(entry["crc64nvme"]) == {f.path for f in manifest.files}
        for f in manifest.files:
            want = crc_of((iter_dir(save_dir, iteration) / f.path).read_bytes())
            stored = head(s3_endpoint, bucket, f"{JOB}/iter_{iteration:07d}/{f.path}")
            assert stored["ChecksumCRC64NVME"] == want == entry["crc64nvme"][f.path]
    # The commit marker carries them too: the archive describes itself.
    archived = json.loads(
        ArchiveStore.from_settings(profile.archive).read(f"{JOB}/iter_0000024/manifest.json")
    )
    assert archived["archive"]["crc64nvme"] == logged[1]["crc64nvme"]
    assert "archive check: CRC64NVME by the store, not read back (not in the sample)" in status_lines(
        save_dir
    )


def test_a_store_that_keeps_no_checksums_gets_every_copy_read_back(
    save_dir, tmp_path, options, s3_endpoint, monkeypatch
):
    """An older MinIO or Ceph answers HeadObject without ChecksumCRC64NVME: not a mismatch, but
    nothing proved by it, so the copy is read back whatever the sample says."""
    real = ArchiveStore.head
    monkeypatch.setattr(
        ArchiveStore,
        "head",
        lambda self, key: (lambda s: s and dataclasses.replace(s, crc64nvme=None))(real(self, key)),
    )
    bucket = s3_bucket(s3_endpoint, f"nocrc-{uuid.uuid4().hex[:12]}")
    profile = s3_profile(tmp_path, save_dir, s3_endpoint, bucket)
    for iteration in (20, 24):
        promote(save_dir, options, 30, requested=iteration)
        assert archive_checkpoint(save_dir, profile, force=True).committed
    logged = copies(save_dir)
    assert [c["read_back"] for c in logged] == [True, True]  # the second is outside the sample
    assert logged[1]["checksum"] == "none kept by the store"
    assert logged[1]["verified"].startswith(
        "the store keeps no checksums: sizes only; every object read back"
    )
    again = archive_checkpoint(save_dir, profile)  # not taken for a damaged copy on the next run
    assert not again.committed and again.message == "iteration 24 is already archived"


def test_a_local_directory_archive_still_reads_every_copy_back(save_dir, tmp_path, options, monkeypatch):
    profile = load_profile(write_job_profile(tmp_path, save_dir, str(tmp_path / "archive")))
    read = []
    real = ArchiveStore.hash_object
    monkeypatch.setattr(
        ArchiveStore,
        "hash_object",
        lambda self, key, *a, **k: (read.append(key), real(self, key, *a, **k))[1],
    )
    for iteration in (20, 24):
        promote(save_dir, options, 30, requested=iteration)
        read.clear()
        assert archive_checkpoint(save_dir, profile, force=True).committed
        names = {f.path for f in read_manifest(iter_dir(save_dir, iteration)).files}
        assert sorted(read) == sorted(f"{JOB}/iter_{iteration:07d}/{n}" for n in names)
    assert [c["read_back"] for c in copies(save_dir)] == [True, True]


def _overwrite(endpoint, bucket, key, data):
    """Another writer replaces an object with bytes of the same size (and their own CRC64NVME)."""
    boto3.client("s3", endpoint_url=endpoint).put_object(
        Bucket=bucket, Key=f"c/{key}", Body=data, ChecksumAlgorithm="CRC64NVME"
    )


def test_a_committed_copy_whose_stored_checksum_differs_is_uncommitted_and_copied_again(
    save_dir, tmp_path, options, s3_endpoint
):
    promote(save_dir, options, 30)
    bucket = s3_bucket(s3_endpoint, f"differ-{uuid.uuid4().hex[:12]}")
    profile = s3_profile(tmp_path, save_dir, s3_endpoint, bucket)
    assert archive_checkpoint(save_dir, profile).committed
    key = f"{JOB}/iter_0000024/__1_0.distcp"
    local = (iter_dir(save_dir, 24) / "__1_0.distcp").read_bytes()
    damaged = bytearray(local)
    damaged[len(damaged) // 2] ^= 0x01
    _overwrite(s3_endpoint, bucket, key, bytes(damaged))  # same size: a listing cannot see it
    again = archive_checkpoint(save_dir, profile, force=True)
    assert again.committed and again.uploaded_bytes > 0, again.message
    assert (
        "the committed copy had 1 objects whose stored checksum differs from the one committed "
        "(__1_0.distcp): uncommitted and copied again" in again.message
    )
    assert head(s3_endpoint, bucket, key)["ChecksumCRC64NVME"] == crc_of(local)
    assert archive_checkpoint(save_dir, profile, force=True).message == "iteration 24 is already archived"


def test_an_object_changed_before_the_check_is_uploaded_again_or_nothing_is_committed(
    save_dir, tmp_path, options, s3_endpoint, monkeypatch
):
    """Between the upload and the check another writer replaces an object: the store's checksum
    differs, so it goes up once more; if it differs again, one line names it and nothing commits."""
    promote(save_dir, options, 30)
    key = f"{JOB}/iter_0000024/__0_0.distcp"
    real = ArchiveStore.put_checked_files
    times = {"left": 1}

    def upload_then_overwrite(self, items, hashing, progress=None):
        sent = real(self, items, hashing, progress)
        if times["left"] and key in sent:
            times["left"] -= 1
            _overwrite(s3_endpoint, bucket, key, b"\0" * sent[key].size)
        return sent

    monkeypatch.setattr(ArchiveStore, "put_checked_files", upload_then_overwrite)
    bucket = s3_bucket(s3_endpoint, f"before-{uuid.uuid4().hex[:12]}")
    profile = s3_profile(tmp_path, save_dir, s3_endpoint, bucket)
    assert archive_checkpoint(save_dir, profile).committed
    local = (iter_dir(save_dir, 24) / "__0_0.distcp").read_bytes()
    assert head(s3_endpoint, bucket, key)["ChecksumCRC64NVME"] == crc_of(local)

    times["left"] = 2  # the re-upload is overwritten too
    bucket = s3_bucket(s3_endpoint, f"before-{uuid.uuid4().hex[:12]}")
    profile = s3_profile(tmp_path, save_dir, s3_endpoint, bucket)
    with pytest.raises(ArchiveUnavailable) as failed:
        archive_checkpoint(save_dir, profile)
    line = str(failed.value)
    assert line.startswith(f"s3://{bucket}/c/{key}: the store holds ") and line.endswith("not committed")
    assert "\n" not in line
    assert committed_iterations(ArchiveStore.from_settings(profile.archive), JOB) == []


def test_sse_kms_with_a_bucket_key_is_sent_checked_and_recorded(save_dir, tmp_path, options, s3_endpoint):
    promote(save_dir, options, 30)
    key_id = boto3.client("kms", endpoint_url=s3_endpoint).create_key()["KeyMetadata"]["KeyId"]
    bucket = s3_bucket(s3_endpoint, f"kms-{uuid.uuid4().hex[:12]}")
    profile = s3_profile(tmp_path, save_dir, s3_endpoint, bucket, f", sse: 'aws:kms', kms_key_id: '{key_id}'")
    assert archive_checkpoint(save_dir, profile).committed
    for f in read_manifest(iter_dir(save_dir, 24)).files + [None]:
        stored = head(s3_endpoint, bucket, f"{JOB}/iter_0000024/{f.path if f else 'manifest.json'}")
        assert stored["ServerSideEncryption"] == "aws:kms" and stored["SSEKMSKeyId"].endswith(key_id)
        assert stored["BucketKeyEnabled"] is True
    (logged,) = copies(save_dir)
    assert logged["encryption"] == {"sse": "aws:kms", "kms_key_id": key_id, "bucket_key": True}
    from typer.testing import CliRunner

    from tasks.cli import app

    shown = CliRunner().invoke(app, ["status", "--profile", str(profile.source)])
    assert shown.exit_code == 0, shown.output
    assert f"archive encryption: aws:kms key {key_id}, bucket key\n" in shown.output
    assert f"newest: iteration 24 at s3://{bucket}/c/{JOB}/iter_0000024, committed " in shown.output


def test_sse_s3_and_the_stores_default_are_recorded_as_the_store_reports_them(
    save_dir, tmp_path, options, s3_endpoint
):
    promote(save_dir, options, 30)
    for sse, reported in (("AES256", "AES256"), ("none", "none reported")):  # moto reports no default
        bucket = s3_bucket(s3_endpoint, f"sse-{uuid.uuid4().hex[:12]}")
        profile = s3_profile(tmp_path, save_dir, s3_endpoint, bucket, f", sse: '{sse}'")
        assert archive_checkpoint(save_dir, profile).committed
        assert copies(save_dir)[-1]["encryption"]["sse"] == reported


def test_a_kms_error_from_the_store_is_one_line_with_its_code_and_nothing_is_committed(
    save_dir, tmp_path, options, s3_endpoint, monkeypatch
):
    """moto stores any KMS key id without asking KMS, so the error S3 returns for a key that does
    not exist (KMS.NotFoundException, HTTP 400) is raised inside the server, for that key only."""
    from moto.s3.exceptions import S3ClientError
    from moto.s3.models import S3Backend

    real = S3Backend.put_object

    def put_object(self, *args, **kwargs):
        if kwargs.get("kms_key_id") == "no-such-key":
            raise S3ClientError("KMS.NotFoundException", "Invalid keyId 'no-such-key'")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "put_object", put_object)
    promote(save_dir, options, 30)
    bucket = s3_bucket(s3_endpoint, f"badkms-{uuid.uuid4().hex[:12]}")
    profile = s3_profile(
        tmp_path, save_dir, s3_endpoint, bucket, ", sse: 'aws:kms', kms_key_id: 'no-such-key'"
    )
    with pytest.raises(ArchiveUnavailable) as failed:
        archive_checkpoint(save_dir, profile)
    line = str(failed.value)
    assert "\n" not in line and line.startswith(f"s3://{bucket}/c/{JOB}/iter_0000024/")
    assert line.endswith(": upload refused by the store (KMS.NotFoundException: Invalid keyId 'no-such-key')")
    assert (
        committed_iterations(ArchiveStore.from_settings(profile.archive), JOB) == []
        and copies(save_dir) == []
    )


def test_object_lock_on_a_bucket_without_it_is_one_line_and_nothing_is_uploaded(
    save_dir, tmp_path, options, s3_endpoint
):
    promote(save_dir, options, 30)
    bucket = s3_bucket(s3_endpoint, f"nolock-{uuid.uuid4().hex[:12]}")
    profile = s3_profile(
        tmp_path, save_dir, s3_endpoint, bucket, ", object_lock: {mode: GOVERNANCE, days: 1}"
    )
    with pytest.raises(ArchiveUnavailable) as failed:
        archive_checkpoint(save_dir, profile)
    assert str(failed.value).startswith(f"s3://{bucket}/c/: object lock configuration refused by the store ")
    assert "(ObjectLockConfigurationNotFoundError: " in str(failed.value)
    assert boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket).get("KeyCount") == 0


def test_archive_retention_never_deletes_a_locked_copy_before_its_date_and_says_until_when(
    save_dir, tmp_path, options, s3_endpoint, monkeypatch
):
    bucket = f"lock-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket=bucket, ObjectLockEnabledForBucket=True)
    profile = s3_profile(
        tmp_path, save_dir, s3_endpoint, bucket, ", object_lock: {mode: GOVERNANCE, days: 1}", keep=2
    )
    removed = []
    for name in ("remove", "remove_versions"):
        real = getattr(ArchiveStore, name)
        monkeypatch.setattr(
            ArchiveStore,
            name,
            lambda self, key, *a, _real=real, **k: (removed.append(key), _real(self, key, *a, **k))[1],
        )
    results = {}
    for iteration in (16, 20, 24):
        promote(save_dir, options, 30, requested=iteration)
        results[iteration] = archive_checkpoint(save_dir, profile, force=True)
        assert results[iteration].committed
    store = ArchiveStore.from_settings(profile.archive)
    assert committed_iterations(store, JOB) == [16, 20, 24] and results[24].deleted == []
    until = datetime.fromisoformat(copies(save_dir)[0]["object_lock"]["retain_until"])
    assert timedelta(hours=23) < until - datetime.now(UTC) <= timedelta(days=1)
    assert results[24].kept == [
        f"archive copy of iteration 16 kept: Object Lock (GOVERNANCE) until {until.isoformat()}; "
        "archive retention can delete it from then"
    ]
    assert not [key for key in removed if "iter_0000016" in key]  # never even tried
    for f in read_manifest(iter_dir(save_dir, 16)).files + [None]:
        stored = head(s3_endpoint, bucket, f"{JOB}/iter_0000016/{f.path if f else 'manifest.json'}")
        assert stored["ObjectLockMode"] == "GOVERNANCE" and stored["ObjectLockRetainUntilDate"] == until
    newest = copies(save_dir)[-1]["object_lock"]["retain_until"]
    assert f"archive object lock: GOVERNANCE until {newest}" in status_lines(save_dir)
    # The lock is the store's: a delete of a locked version is refused. Were retention to try
    # (its own date check taken away here), the run fails with one line and the store's code.
    locked = s3.list_object_versions(Bucket=bucket, Prefix=f"c/{JOB}/iter_0000016/__0_0.distcp")["Versions"][
        0
    ]
    with pytest.raises(ClientError, match="AccessDenied"):
        s3.delete_object(Bucket=bucket, Key=locked["Key"], VersionId=locked["VersionId"])
    monkeypatch.setattr(retention, "locked_until", lambda *a: None)
    with pytest.raises(ArchiveUnavailable) as failed:
        apply_archive_retention(store, JOB, keep=2)
    line = str(failed.value)
    assert "\n" not in line and line.startswith(f"s3://{bucket}/c/{JOB}/iter_0000016/")
    assert ": delete refused by the store (AccessDenied: " in line


def test_keep_days_keeps_young_copies_beyond_keep_and_pins_keep_theirs(save_dir, tmp_path, options):
    """A copy goes only when both the count (keep) and the period (keep_days) let it."""
    profile = load_profile(
        write_job_profile(
            tmp_path, save_dir, str(tmp_path / "archive"), keep=2, extra_archive=", keep_days: 2"
        )
    )
    for iteration in (16, 20, 24):
        promote(save_dir, options, 30, requested=iteration)
        assert archive_checkpoint(save_dir, profile, force=True).deleted == []
    store = ArchiveStore.from_settings(profile.archive)
    assert committed_iterations(store, JOB) == [16, 20, 24]
    # Iteration 16's copy ages past the period (its commit time, as recorded in its manifest).
    key = f"{JOB}/iter_0000016/manifest.json"
    archived = json.loads(store.read(key))
    archived["archive"]["committed_at"] = (datetime.now(UTC) - timedelta(days=3)).isoformat()
    store.write(key, json.dumps(archived).encode())
    assert apply_archive_retention(store, JOB, keep=2, keep_days=2, pinned_iterations={16}) == []
    assert apply_archive_retention(store, JOB, keep=2, keep_days=2) == [16]
    assert committed_iterations(store, JOB) == [20, 24]


def test_protection_needs_an_s3_archive(tmp_path):
    for extra in (", sse: 'AES256'", ", object_lock: {mode: COMPLIANCE, days: 30}"):
        with pytest.raises(UsageError, match="need an s3:// archive"):
            load_profile(write_job_profile(tmp_path, tmp_path, str(tmp_path / "a"), extra_archive=extra))
    with pytest.raises(UsageError, match="kms_key_id needs sse: aws:kms"):
        load_profile(write_job_profile(tmp_path, tmp_path, "s3://b/c", extra_archive=", kms_key_id: k"))


def _medium_profile(tmp_path, medium_save_dir, s3_endpoint, options, extra=""):
    promote(medium_save_dir, options, 30)
    bucket = s3_bucket(s3_endpoint, f"parts-{uuid.uuid4().hex[:12]}")
    profile = s3_profile(tmp_path, medium_save_dir, s3_endpoint, bucket, ", multipart_chunk_mb: 5" + extra)
    return bucket, profile


def _nothing_left(endpoint, bucket, profile) -> None:
    s3 = boto3.client("s3", endpoint_url=endpoint)
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []  # aborted
    assert committed_iterations(ArchiveStore.from_settings(profile.archive), JOB) == []


def test_a_source_file_changed_since_verification_is_not_archived(
    medium_save_dir, tmp_path, s3_endpoint, options
):
    """The read that uploads also re-hashes: a file that no longer hashes as its manifest says
    (bit rot after the verification) is not archived, its multipart upload aborted."""
    bucket, profile = _medium_profile(tmp_path, medium_save_dir, s3_endpoint, options)
    big = max(read_manifest(iter_dir(medium_save_dir, 4)).files, key=lambda f: f.size)
    assert big.size > 2 * (5 << 20)
    flip_byte(iter_dir(medium_save_dir, 4) / big.path, big.size - 10)  # in its last part
    with pytest.raises(SourceChanged) as failed:
        archive_checkpoint(medium_save_dir, profile)
    line = str(failed.value)
    assert "\n" not in line and line.startswith(f"{iter_dir(medium_save_dir, 4) / big.path}: reads ")
    assert line.endswith("the source changed since it was verified; not archived")
    _nothing_left(s3_endpoint, bucket, profile)
    assert head_or_none(s3_endpoint, bucket, f"{JOB}/iter_0000004/{big.path}") is None


def head_or_none(endpoint, bucket, key):
    try:
        return head(endpoint, bucket, key)
    except ClientError:
        return None


def test_a_part_the_store_refuses_is_one_line_and_the_upload_is_aborted(
    medium_save_dir, tmp_path, s3_endpoint, options, monkeypatch
):
    from moto.s3.exceptions import S3ClientError
    from moto.s3.models import S3Backend

    real = S3Backend.upload_part

    def upload_part(self, bucket_name, multipart_id, part_id, value):
        if part_id == 2:
            raise S3ClientError("SlowDown", "Please reduce your request rate.")
        return real(self, bucket_name, multipart_id, part_id, value)

    monkeypatch.setattr(S3Backend, "upload_part", upload_part)
    # One attempt: botocore would retry a SlowDown, and the injected one answers every time.
    bucket, profile = _medium_profile(tmp_path, medium_save_dir, s3_endpoint, options, ", max_attempts: 1")
    with pytest.raises(ArchiveUnavailable) as failed:
        archive_checkpoint(medium_save_dir, profile)
    line = str(failed.value)
    assert "\n" not in line and line.startswith(f"s3://{bucket}/c/{JOB}/iter_0000004/")
    assert line.endswith(": upload refused by the store (SlowDown: Please reduce your request rate.)")
    _nothing_left(s3_endpoint, bucket, profile)
