"""The many-file, many-record path of verification, on a small checkpoint of the seed's shape
(``tests/bench/seed_scale.py``: TP 2, PP 2, DP 4 with the distributed optimizer, 16 data files,
about 2,000 records, written by megatron-core's and torch's own save code per simulated rank, the
common state from a real Megatron-LM run): the bench measures the same code at 5,120 files."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.checkpoint import scan, torchsave
from tasks.checkpoint.dcp import build_index, load_dcp_metadata
from tasks.checkpoint.scan import scan_files
from tasks.checkpoint.state import State, VerifyOptions
from tasks.checkpoint.verify import verify_checkpoint
from tests.conftest import ROOT, flip_byte


@pytest.fixture(scope="module")
def seed_shaped(variety, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("seed-shaped")
    source = variety["tp2-distopt-bf16"] / "iter_0000004"
    command = [
        sys.executable,
        "-m",
        "tests.bench.seed_scale",
        str(save),
        "--tp",
        "2",
        "--pp",
        "2",
        "--dp",
        "4",
    ]
    command += ["--records", "2000", "--source", str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return save / "iter_0000100"


@pytest.fixture
def copy(seed_shaped, tmp_path) -> Path:
    return shutil.copytree(seed_shaped, tmp_path / "iter_0000100")


def test_a_checkpoint_of_the_seeds_shape_verifies(copy):
    result = verify_checkpoint(copy, VerifyOptions(job="seed-shaped"))
    assert result.state is State.VALID, result.reason
    index = build_index(load_dcp_metadata(copy / ".metadata"))
    assert len(index.files) == 16 and len(index.records) > 1500
    assert {c.name for c in result.checks} >= {"files", "records", "coverage", "crc", "values", "optimizer"}


def test_a_flipped_element_in_one_of_many_files_names_the_file_and_record(copy):
    index = build_index(load_dcp_metadata(copy / ".metadata"))
    name = sorted(index.files)[7]
    record = next(r for r in index.files[name] if "@" in r.key and r.length <= scan.SMALL_RECORD)
    with open(copy / name, "rb") as f:
        elements = torchsave.entries(memoryview(f.read()[record.offset : record.end])).elements[0]
    flip_byte(copy / name, record.offset + (elements.start + elements.end) // 2)
    result = verify_checkpoint(copy, VerifyOptions(job="seed-shaped"))
    assert result.state is State.INVALID
    crc = [c for c in result.checks if not c.ok and c.name == "crc"]
    assert [c.file for c in crc] == [name] and f"record '{record.key}'" in crc[0].detail, result.reason


def test_every_file_scans_the_same_in_runs_and_record_by_record(copy, monkeypatch):
    index = build_index(load_dcp_metadata(copy / ".metadata"))

    def scanned():
        scans = scan_files(copy, index.files)
        return {
            name: (s.hash, s.failures, sorted((v.offset, v.crc, v.numel, v.min, v.max) for v in s.values))
            for name, s in scans.items()
        }

    fast = scanned()
    monkeypatch.setattr(scan, "SMALL_RECORD", 0)
    assert scanned() == fast
    assert sum(len(v[2]) for v in fast.values()) > 1000  # the tensor records' values were taken
