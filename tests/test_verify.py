"""Verification on real checkpoints from the local training job, and on every way to break one."""

import io
import json
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch

from tasks.checkpoint.dcp import Record, build_index, load_dcp_metadata, read_record
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.scan import plan_crc_ranges, scan_file
from tasks.checkpoint.state import State
from tasks.errors import Unreadable, UsageError
from tests.conftest import flip_byte, iter_dir, verify_and_record_here


def tensor_data_offset(directory: Path, name: str) -> int:
    """An offset in the middle of a tensor's stored bytes (not a zip header) in file ``name``."""
    index = build_index(load_dcp_metadata(directory / ".metadata"))
    fd = os.open(directory / name, os.O_RDONLY)
    try:
        for record in index.files[name]:
            if "@" not in record.key:
                continue
            for r in plan_crc_ranges(fd, record):
                if r.label.endswith("archive/data/0") and r.end - r.start >= 64:
                    return (r.start + r.end) // 2
    finally:
        os.close(fd)
    raise AssertionError(f"no tensor data in {name}")


def test_real_checkpoint_is_valid_and_manifest_records_it(save_dir, options):
    directory = iter_dir(save_dir, 8)
    result = verify_and_record_here(directory, options)
    assert result.state is State.VALID, result.reason
    manifest = read_manifest(directory)
    assert manifest.valid and manifest.iteration == 8 and manifest.job == "test"
    assert manifest.consumed_train_samples == 64  # 8 iterations x global batch 8
    assert manifest.writer["megatron_core"] == "0.19.2" and manifest.writer["sharded_backend"] == "torch_dist"
    assert manifest.layout == {
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "data_parallel": 2,
        "world_size": 2,
    }
    on_disk = {p.name: p.stat().st_size for p in directory.iterdir() if p.name != "manifest.json"}
    assert {f.path: f.size for f in manifest.files} == on_disk
    assert manifest.totals["bytes"] == sum(on_disk.values())
    names = {c.name for c in manifest.checks}
    assert {
        "metadata.json",
        "dcp-metadata",
        "files",
        "records",
        "coverage",
        "objects",
        "crc",
        "integrity.json",
        "state",
        "iteration",
    } <= names
    assert all(c.ok for c in manifest.checks)


def settle(directory: Path) -> None:
    """Make a hand-edited checkpoint look like a save that finished a while ago: shards older
    than metadata.json, and metadata.json older than the settle time."""
    now = time.time()
    for path in directory.iterdir():
        when = now - 60 if path.name in ("metadata.json", "integrity.json") else now - 120
        os.utime(path, (when, when))


def _reason(directory, options):
    result = verify_and_record_here(directory, options)
    assert result.state is State.INVALID, result.line()
    assert "\n" not in result.reason
    return result


def test_flipped_byte_caught_on_first_verification(save_dir, options):
    directory = iter_dir(save_dir, 8)
    assert read_manifest(directory) is None
    flip_byte(directory / "__1_0.distcp", tensor_data_offset(directory, "__1_0.distcp"))
    result = _reason(directory, options)
    assert result.reason.startswith("__1_0.distcp: ") and "[crc]" in result.reason
    assert "CRC" in result.reason


def test_truncated_data_file(save_dir, options):
    directory = iter_dir(save_dir, 8)
    path = directory / "__0_0.distcp"
    before = path.stat()
    os.truncate(path, before.st_size // 2)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # damaged later, not re-saved
    result = _reason(directory, options)
    assert result.reason.startswith("__0_0.distcp: truncated") and "[files]" in result.reason


@pytest.mark.parametrize("name", ["__0_0.distcp", "__1_0.distcp"])  # rank 0's holds the common state
def test_missing_data_file(save_dir, options, name):
    directory = iter_dir(save_dir, 8)
    (directory / name).unlink()
    result = _reason(directory, options)
    assert result.reason.startswith(f"{name}: referenced by .metadata but missing [files]")


def test_extra_unreferenced_data_file(save_dir, options):
    directory = iter_dir(save_dir, 8)
    extra = directory / "__2_0.distcp"
    extra.write_bytes(b"x" * 100)
    os.utime(extra, ns=(0, 0))  # old, so it is not mistaken for a re-save in progress
    result = _reason(directory, options)
    assert "__2_0.distcp: data file not referenced by .metadata [files]" in result.reason


def test_missing_metadata_json_on_finished_job_is_invalid(save_dir, options):
    directory = iter_dir(save_dir, 8)  # iteration 12 finished saving after it
    (directory / "metadata.json").unlink()
    result = _reason(directory, options)
    assert result.reason.startswith("metadata.json: missing") and "[complete]" in result.reason


def test_missing_metadata_json_on_newest_is_in_progress_and_writes_nothing(save_dir, options):
    directory = iter_dir(save_dir, 24)
    (directory / "metadata.json").unlink()
    result = verify_and_record_here(directory, options)
    assert result.state is State.IN_PROGRESS and "metadata.json" in result.reason
    assert not (directory / "manifest.json").exists()


def test_stale_save_without_metadata_json_is_abandoned(save_dir, options):
    directory = iter_dir(save_dir, 24)
    (directory / "metadata.json").unlink()
    old = time.time() - 2 * options.abandon_after_seconds
    for path in directory.iterdir():
        os.utime(path, (old, old))
    result = _reason(directory, options)
    assert result.reason.startswith("metadata.json: missing, no change for")


def test_garbled_metadata_json(save_dir, options):
    directory = iter_dir(save_dir, 8)
    (directory / "metadata.json").write_text('{"sharded_backend": "torch_di')
    settle(directory)
    result = _reason(directory, options)
    assert result.reason.startswith("metadata.json: unreadable") and "[metadata.json]" in result.reason


def test_garbled_metadata_json_just_written_is_in_progress(save_dir, options):
    directory = iter_dir(save_dir, 8)
    (directory / "metadata.json").write_text('{"sharded_back')  # Megatron's plain open('w'), mid-write
    result = verify_and_record_here(directory, options)
    assert result.state is State.IN_PROGRESS and result.reason == "metadata.json: still being written"


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"sharded_backend": "zarr", "sharded_backend_version": 1}', "unknown sharded_backend 'zarr'"),
        ("{}", "not a Megatron checkpoint config"),
        ('{"sharded_backend": []}', "not a Megatron checkpoint config"),
        ("[1, 2]", "not a Megatron checkpoint config"),
    ],
)
def test_metadata_json_that_parses_but_is_wrong(save_dir, options, text, message):
    directory = iter_dir(save_dir, 8)
    (directory / "metadata.json").write_text(text)
    settle(directory)
    result = _reason(directory, options)
    assert result.reason.startswith(f"metadata.json: {message}")


def test_garbled_dcp_metadata(save_dir, options):
    directory = iter_dir(save_dir, 8)
    path = directory / ".metadata"
    data = bytearray(path.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    result = _reason(directory, options)
    assert result.reason.startswith(".metadata: unreadable") and "[dcp-metadata]" in result.reason


def test_malicious_dcp_metadata_is_refused_not_executed(save_dir, options, tmp_path):
    directory = iter_dir(save_dir, 8)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (directory / ".metadata").write_bytes(pickle.dumps(Exploit()))
    result = _reason(directory, options)
    assert "is not allowed in DCP metadata" in result.reason and "system" in result.reason
    assert not marker.exists()


def test_tensor_chunks_leaving_a_gap(save_dir, options):
    directory = iter_dir(save_dir, 8)
    metadata = load_dcp_metadata(directory / ".metadata")
    name, item = next(
        (k, v) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks") and len(v.chunks) == 2
    )
    first = item.chunks[0]
    first.sizes = torch.Size([first.sizes[0], first.sizes[1] - 1, *first.sizes[2:]])
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    result = _reason(directory, options)
    assert (
        result.reason.startswith(f".metadata: tensor '{name}': chunks cover")
        and "[coverage]" in result.reason
    )


def test_integrity_json_mismatch(save_dir, options):
    directory = iter_dir(save_dir, 8)
    path = directory / "integrity.json"
    integrity = json.loads(path.read_text())
    integrity["files"]["__1_0.distcp"] = "0" * 64
    path.write_text(json.dumps(integrity))
    result = _reason(directory, options)
    assert result.reason.startswith("__1_0.distcp: sha256 differs from integrity.json [integrity.json]")


def test_iteration_not_matching_directory(save_dir, options):
    directory = iter_dir(save_dir, 8)
    renamed = directory.rename(iter_dir(save_dir, 9))
    result = _reason(renamed, options)
    assert "common state says iteration 8, the directory 9 [iteration]" in result.reason
    assert result.reason.startswith("__0_0.distcp: ")


def test_reverification_catches_flip_against_manifest(save_dir, options):
    directory = iter_dir(save_dir, 8)
    first = verify_and_record_here(directory, options)
    assert first.state is State.VALID
    reference = read_manifest(directory)
    flip_byte(directory / "__0_0.distcp", tensor_data_offset(directory, "__0_0.distcp"))
    result = _reason(directory, options)
    failing = {(c.name, c.file) for c in result.checks if not c.ok}
    assert ("manifest", "__0_0.distcp") in failing
    after = read_manifest(directory)
    assert after.status == "invalid" and "__0_0.distcp" in after.reason
    assert after.files == reference.files and after.verified_at == reference.verified_at


def test_flip_outside_crc_coverage_found_by_manifest(save_dir, options):
    """A flip in a zip header's padding escapes the record CRCs; the manifest hash catches it."""
    directory = iter_dir(save_dir, 8)
    assert verify_and_record_here(directory, options).state is State.VALID
    index = build_index(load_dcp_metadata(directory / ".metadata"))
    record = index.files["__1_0.distcp"][0]
    fd = os.open(directory / "__1_0.distcp", os.O_RDONLY)
    try:
        covered = plan_crc_ranges(fd, record)
    finally:
        os.close(fd)
    # The local header of the first entry: inside the record, outside every CRC range.
    offset = record.offset + 20
    assert all(not (r.start <= offset < r.end) for r in covered)
    flip_byte(directory / "__1_0.distcp", offset)
    result = _reason(directory, options)
    assert ("manifest", "__1_0.distcp") in {(c.name, c.file) for c in result.checks if not c.ok}


def test_file_changing_during_read_is_in_progress(save_dir, options):
    directory = iter_dir(save_dir, 8)
    touched = []
    # The verifier reads the largest file first: a writer appends to it after its first buffer.
    first = max(directory.glob("*.distcp"), key=lambda p: p.stat().st_size)

    def writer_still_at_work(nbytes):
        if not touched:
            with open(first, "ab") as f:
                f.write(b"\0")
            touched.append(True)

    result = verify_and_record_here(directory, options, progress=writer_still_at_work)
    assert result.state is State.IN_PROGRESS and "changed while being read" in result.reason
    assert not (directory / "manifest.json").exists()


def test_resave_into_existing_directory_is_in_progress(save_dir, options):
    directory = iter_dir(save_dir, 8)
    settle(directory)
    os.utime(directory / "__1_0.distcp")  # a shard rewritten now, a minute after metadata.json
    result = verify_and_record_here(directory, options)
    assert result.state is State.IN_PROGRESS and "being re-saved" in result.reason


def test_shards_changed_long_after_the_save_are_judged_not_waited_for(save_dir, options):
    directory = iter_dir(save_dir, 8)
    path = directory / "__1_0.distcp"
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\xff" * 16)
    old = time.time() - 2 * options.abandon_after_seconds
    for p in directory.iterdir():
        os.utime(p, (old, old))
    os.utime(path, (old + 60, old + 60))  # rewritten after metadata.json, then left alone
    result = _reason(directory, options)
    assert result.reason.startswith("__1_0.distcp: ")


def test_expected_integrity_json_not_yet_written_is_in_progress(save_dir, options):
    from dataclasses import replace

    directory = iter_dir(save_dir, 8)
    (directory / "integrity.json").unlink()
    result = verify_and_record_here(directory, replace(options, writes_integrity_json=True))
    assert result.state is State.IN_PROGRESS and "integrity.json" in result.reason


def test_not_a_checkpoint_directory_is_a_usage_error(save_dir, options):
    with pytest.raises(UsageError, match="not a checkpoint directory"):
        verify_and_record_here(save_dir, options)
    with pytest.raises(UsageError, match="no such checkpoint directory"):
        verify_and_record_here(save_dir / "iter_0000999", options)
    with pytest.raises(UsageError, match="not a checkpoint directory"):
        verify_and_record_here(save_dir / "iter_00000008", options)  # Megatron would never load it


def test_symlinked_checkpoint_is_refused_not_followed(save_dir, options):
    (save_dir / "iter_0000099").symlink_to(iter_dir(save_dir, 4))
    with pytest.raises(UsageError, match="iter_0000099: is a symlink"):
        verify_and_record_here(save_dir / "iter_0000099", options)


def test_unreadable_file_is_an_environment_error_not_a_verdict(save_dir, options, monkeypatch):
    import tasks.checkpoint.scan as scan

    directory = iter_dir(save_dir, 8)
    real_open = os.open

    def denied(path, *args, **kwargs):
        if str(path).endswith("__1_0.distcp"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(scan.os, "open", denied)
    with pytest.raises(Unreadable, match="__1_0.distcp: Permission denied") as caught:
        verify_and_record_here(directory, options)
    assert caught.value.exit_code == 2
    assert not (directory / "manifest.json").exists()


def test_unreadable_manifest_is_kept_as_evidence(save_dir, options):
    directory = iter_dir(save_dir, 8)
    assert verify_and_record_here(directory, options).state is State.VALID
    garbled = b'{"schema_version": 1, "files": [{"pa'
    (directory / "manifest.json").write_bytes(garbled)
    for _ in range(2):  # a second run must not accept what the first could not check
        result = _reason(directory, options)
        assert result.reason.startswith("manifest.json: ") and "move it aside" in result.reason
        assert (directory / "manifest.json").read_bytes() == garbled


def test_manifest_of_another_iteration_is_not_a_reference(save_dir, options):
    verify_and_record_here(iter_dir(save_dir, 4), options)
    shutil.copy(iter_dir(save_dir, 4) / "manifest.json", iter_dir(save_dir, 8) / "manifest.json")
    result = _reason(iter_dir(save_dir, 8), options)
    assert "manifest.json: describes iteration 4, not 8 [manifest]" in result.reason


def test_a_manifest_is_compared_as_it_was_hashed_and_one_hashed_an_unknown_way_is_no_reference(
    save_dir, options
):
    directory = iter_dir(save_dir, 8)
    assert verify_and_record_here(directory, options).state is State.VALID
    data = json.loads((directory / "manifest.json").read_text())
    # Its XXH3 hashes claimed as BLAKE3: re-verification hashes as the reference says, and differs.
    data["hash_algorithm"] = "blake3"
    (directory / "manifest.json").write_text(json.dumps(data))
    result = verify_and_record_here(directory, options)
    assert result.state is State.INVALID and "content differs from the manifest (blake3)" in result.reason
    data = json.loads((directory / "manifest.json").read_text())  # the newest verdict, not one put back
    data["hash_algorithm"] = "md5"
    (directory / "manifest.json").write_text(json.dumps(data))
    result = verify_and_record_here(directory, options)
    assert result.state is State.VALID and not any(c.name == "manifest" for c in result.checks)
    assert read_manifest(directory).hash_algorithm == "xxh3-128"


def test_resave_after_verification_is_judged_afresh(save_dir, options):
    directory = iter_dir(save_dir, 8)
    first = verify_and_record_here(directory, options)
    assert first.state is State.VALID
    metadata = directory / "metadata.json"
    before = metadata.stat().st_mtime_ns
    metadata.write_bytes(metadata.read_bytes())  # Megatron re-saving: the same bytes, a new save
    os.utime(metadata, ns=(before + 10**9, before + 10**9))  # a save's time is later than the one before
    settle(directory)
    again = verify_and_record_here(directory, options)
    assert again.state is State.VALID
    manifest = read_manifest(directory)
    assert manifest.save_identity != first.manifest.save_identity
    assert manifest.verified_at >= first.manifest.verified_at


def test_megatron_integrity_json_written_after_our_manifest(save_dir, options):
    """Megatron finalises integrity.json after metadata.json, hashing every top-level file: if
    we verified first, it lists our manifest. That must not turn a good checkpoint invalid."""
    from megatron.core.dist_checkpointing.validation import save_integrity_manifest

    directory = iter_dir(save_dir, 8)
    (directory / "integrity.json").unlink()
    assert verify_and_record_here(directory, options).state is State.VALID
    save_integrity_manifest(str(directory))
    assert "manifest.json" in json.loads((directory / "integrity.json").read_text())["files"]
    result = verify_and_record_here(directory, options)
    assert result.state is State.VALID, result.reason
    assert any(c.name == "manifest" and "integrity.json added since" in c.detail for c in result.checks)


def test_every_single_bit_flip_in_a_record_is_caught_or_harmless(save_dir):
    """Every bit of a small tensor record (zip headers, data, central directory, end record),
    flipped in turn, one at a time: the scan must flag it, or torch.load must still give the same
    tensor."""
    directory = iter_dir(save_dir, 8)
    index = build_index(load_dcp_metadata(directory / ".metadata"))
    smallest = min((r for r in index.files["__1_0.distcp"] if "@" in r.key), key=lambda r: r.length)
    # The record alone, in a file of its own: the scan reads the same bytes in the same way, and
    # each of the record's bits costs one short scan instead of one of the whole data file.
    path = save_dir / "one-record.distcp"
    path.write_bytes(read_record(directory, smallest))
    record = Record(smallest.key, path.name, 0, smallest.length)
    records = [record]
    original = path.read_bytes()
    reference = torch.load(io.BytesIO(original), weights_only=True)
    missed = []
    fd = os.open(path, os.O_RDWR)
    try:
        for offset, bit in ((o, 1 << b) for o in range(record.offset, record.end) for b in range(8)):
            os.pwrite(fd, bytes([original[offset] ^ bit]), offset)
            scan = scan_file(path, records)
            if not scan.failures:
                damaged = bytearray(original[record.offset : record.end])
                damaged[offset - record.offset] ^= bit
                try:
                    same = torch.equal(torch.load(io.BytesIO(bytes(damaged)), weights_only=True), reference)
                except Exception:
                    same = False
                if not same:
                    missed.append((offset - record.offset, bit))
            os.pwrite(fd, original[offset : offset + 1], offset)
    finally:
        os.close(fd)
    assert missed == [], f"flips (record offset, bit) {missed[:20]} were neither caught nor harmless"
