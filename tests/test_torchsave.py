"""The strict in-memory reader of torch.save records (``torchsave``) against the careful one
(``scan.plan_crc_ranges``, torch's own reader and zipfile), on records of a real checkpoint."""

import os
import shutil
from pathlib import Path

import pytest

from tasks.checkpoint import scan, torchsave
from tasks.checkpoint.dcp import build_index, load_dcp_metadata
from tasks.checkpoint.scan import plan_crc_ranges, scan_file
from tests.conftest import flip_byte, iter_dir


def careful(path: Path, record) -> list[tuple[int, int, int]] | None:
    """What the careful reader makes of the record: its CRC ranges, or None if it refuses it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return [(r.start, r.end, r.expected) for r in plan_crc_ranges(fd, record)]
    except Exception:
        return None
    finally:
        os.close(fd)


def strict(path: Path, record, reader: torchsave.Reader) -> list[tuple[int, int, int]] | None:
    """What the strict reader makes of the record, by a parse and, once ``reader`` has seen a
    record of its shape, by its skeleton: the two must agree."""
    with open(path, "rb") as f:
        data = memoryview(os.pread(f.fileno(), record.length, record.offset))
    parsed, remembered = torchsave.entries(data), reader.entries(data)
    found = [
        None
        if layout is None
        else sorted((record.offset + e.start, record.offset + e.end, e.crc) for e in layout.entries)
        for layout in (parsed, remembered)
    ]
    assert found[0] == found[1]
    if parsed is not None:
        assert (parsed.pickled, [e.start for e in parsed.elements]) == (
            remembered.pickled,
            [e.start for e in remembered.elements],
        )
    return found[0]


@pytest.fixture(scope="module")
def records(trained):
    directory = iter_dir(trained, 8)
    index = build_index(load_dcp_metadata(directory / ".metadata"))
    tensor = next(r for r in index.files["__0_0.distcp"] if "@" in r.key and r.length <= scan.SMALL_RECORD)
    common = index.records[("common_state/shard_0_1", None)]
    return directory, [tensor, common]


def test_every_header_byte_flipped_is_refused_by_the_strict_reader_or_read_alike(records, tmp_path):
    """A record the strict reader accepts, whatever byte of its zip structure is flipped, is one
    the careful reader accepts with the same entries: the fast path never passes what torch's
    reader would refuse."""
    directory, chosen = records
    for record in chosen:
        path = tmp_path / record.file
        shutil.copyfile(directory / record.file, path)
        whole = careful(path, record)
        reader = torchsave.Reader()
        assert whole is not None and strict(path, record, reader) == sorted(whole)
        assert reader.skeletons  # the flips below are judged by the skeleton first
        covered = [(start, end) for start, end, _ in whole]
        header_bytes = [
            offset
            for offset in range(record.offset, record.end)
            if not any(start <= offset < end for start, end in covered)
        ]
        assert len(header_bytes) > 500  # local headers, descriptors, directory, end records
        refused = 0
        for offset in header_bytes:
            flip_byte(path, offset)
            fast = strict(path, record, reader)
            if fast is None:
                refused += 1
            else:
                assert fast == sorted(careful(path, record) or []), (
                    f"{record.key}: byte {offset - record.offset}"
                )
            flip_byte(path, offset)  # back as it was
        assert refused > len(header_bytes) // 2


def test_a_file_scans_the_same_record_by_record_and_in_runs(records, tmp_path, monkeypatch):
    """Hashes, failures and value statistics: the same whether small records are read in runs and
    checked from memory or each planned with torch's reader."""
    directory, _ = records
    name = "__0_0.distcp"
    index = build_index(load_dcp_metadata(directory / ".metadata"))
    path = tmp_path / name
    shutil.copyfile(directory / name, path)
    tensor = next(r for r in index.files[name] if "@" in r.key and r.length <= scan.SMALL_RECORD)
    flip_byte(path, tensor.end - 200)  # inside the record's last entries or its directory
    flip_byte(path, tensor.offset + tensor.length // 2)

    def scanned():
        result = scan_file(path, index.files[name])
        values = sorted(
            (v.offset, v.crc, v.nan, v.inf, v.numel, v.dtype, v.min, v.max) for v in result.values
        )
        # Sums of squares: accumulated in float64 over a run's records, in float32 by BLAS record
        # by record: equal to float32's precision.
        sumsq = {v.offset: v.sumsq for v in result.values}
        return result.hash, sorted(result.failures), values, sumsq

    *fast, fast_sumsq = scanned()
    monkeypatch.setattr(scan, "SMALL_RECORD", 0)
    *careful, careful_sumsq = scanned()
    assert fast == careful and fast[2]
    assert fast_sumsq == pytest.approx(careful_sumsq, rel=1e-5)
    assert fast[1]  # the flips were found
