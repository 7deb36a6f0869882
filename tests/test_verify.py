"""Verification on real checkpoints from the local training job, and on every way to break one."""

import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch

from tasks.checkpoint.dcp import build_index, load_dcp_metadata
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.scan import plan_crc_ranges
from tasks.checkpoint.state import State
from tasks.checkpoint.verify import verify_checkpoint
from tests.conftest import flip_byte, iter_dir


def tensor_data_offset(directory: Path, name: str) -> int:
    """An offset in the middle of a tensor's stored bytes (not a zip header) in file ``name``."""
    index = build_index(load_dcp_metadata(directory / ".metadata"))
    fd = os.open(directory / name, os.O_RDONLY)
    try:
        for record in index.files()[name]:
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
    result = verify_checkpoint(directory, options)
    assert result.state is State.VALID, result.reason
    manifest = read_manifest(directory)
    assert manifest.valid and manifest.iteration == 8 and manifest.job == "test"
    assert manifest.consumed_train_samples == 64  # 8 iterations x global batch 8
    assert manifest.writer["megatron_core"] == "0.19.2" and manifest.writer["sharded_backend"] == "torch_dist"
    assert manifest.layout == {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 2, "world_size": 2}
    on_disk = {p.name: p.stat().st_size for p in directory.iterdir() if p.name != "manifest.json"}
    assert {f.path: f.size for f in manifest.files} == on_disk
    assert manifest.totals["bytes"] == sum(on_disk.values())
    names = {c.name for c in manifest.checks}
    assert {"metadata.json", "dcp-metadata", "files", "records", "coverage", "objects", "crc",
            "integrity.json", "state", "iteration"} <= names
    assert all(c.ok for c in manifest.checks)


def _reason(directory, options):
    result = verify_checkpoint(directory, options)
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


def test_missing_data_file(save_dir, options):
    directory = iter_dir(save_dir, 8)
    (directory / "__1_0.distcp").unlink()
    result = _reason(directory, options)
    assert result.reason.startswith("__1_0.distcp: referenced by .metadata but missing [files]")


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
    result = verify_checkpoint(directory, options)
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
    for path in directory.glob("*.distcp"):
        os.utime(path, ns=(0, 0))
    result = _reason(directory, options)
    assert result.reason.startswith("metadata.json: unreadable") and "[metadata.json]" in result.reason


def test_unknown_backend(save_dir, options):
    directory = iter_dir(save_dir, 8)
    (directory / "metadata.json").write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    for path in directory.glob("*.distcp"):
        os.utime(path, ns=(0, 0))
    assert "unknown sharded_backend 'zarr'" in _reason(directory, options).reason


def test_garbled_dcp_metadata(save_dir, options):
    directory = iter_dir(save_dir, 8)
    path = directory / ".metadata"
    data = bytearray(path.read_bytes())
    data[len(data) // 3: len(data) // 3 + 64] = b"\xff" * 64
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
    name, item = next((k, v) for k, v in metadata.state_dict_metadata.items()
                      if hasattr(v, "chunks") and len(v.chunks) == 2)
    first = item.chunks[0]
    first.sizes = torch.Size([first.sizes[0], first.sizes[1] - 1, *first.sizes[2:]])
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    result = _reason(directory, options)
    assert result.reason.startswith(f".metadata: tensor '{name}': chunks cover") and "[coverage]" in result.reason


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
    first = verify_checkpoint(directory, options)
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
    assert verify_checkpoint(directory, options).state is State.VALID
    index = build_index(load_dcp_metadata(directory / ".metadata"))
    record = index.files()["__1_0.distcp"][0]
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

    def writer_still_at_work(nbytes):
        if not touched:
            with open(directory / "__1_0.distcp", "ab") as f:
                f.write(b"\0")
            touched.append(True)

    result = verify_checkpoint(directory, options, progress=writer_still_at_work)
    assert result.state is State.IN_PROGRESS and "changed while being read" in result.reason
    assert not (directory / "manifest.json").exists()


def test_resave_into_existing_directory_is_in_progress(save_dir, options):
    directory = iter_dir(save_dir, 8)
    os.utime(directory / "__1_0.distcp")  # a shard rewritten now, after metadata.json
    result = verify_checkpoint(directory, options)
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
    result = verify_checkpoint(directory, replace(options, writes_integrity_json=True))
    assert result.state is State.IN_PROGRESS and "integrity.json" in result.reason


def test_not_a_checkpoint_directory_is_a_usage_error(save_dir, options):
    from tasks.errors import UsageError

    with pytest.raises(UsageError, match="not a checkpoint directory"):
        verify_checkpoint(save_dir, options)
    with pytest.raises(UsageError, match="no such checkpoint directory"):
        verify_checkpoint(save_dir / "iter_0000999", options)
