"""Verification overlapping an asynchronous save (``verify.overlap_save``): data files read as they
settle, taken at the end only if unchanged and laid out as ``.metadata`` says, and nothing judged
before the save is whole."""

import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from tasks.checkpoint.dcp import build_index, load_dcp_metadata
from tasks.checkpoint.prescan import Prescan, walk_records
from tasks.checkpoint.state import State, wait_until_complete
from tasks.errors import UsageError
from tasks.profile import load_profile
from tests.conftest import iter_dir, verify_and_record_here

DATA = ["__0_0.distcp", "__1_0.distcp"]


def test_walking_a_data_file_from_its_end_finds_the_records_metadata_lists(trained, variety, medium_trained):
    directories = [iter_dir(trained, 24), iter_dir(medium_trained, 4)]
    directories += [iter_dir(save, 4) for save in variety.values()]
    for directory in directories:
        files = build_index(load_dcp_metadata(directory / ".metadata")).files
        for name, records in files.items():
            assert walk_records(directory / name) == sorted((r.offset, r.length) for r in records), name


def test_a_file_that_is_not_a_run_of_torch_save_records_is_not_walked(tmp_path):
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(os.urandom(5000))
    assert walk_records(path) is None
    path.write_bytes(b"")
    assert walk_records(path) == []


@pytest.fixture
def saving(trained, tmp_path):
    """A save under way: the directory of iteration 4 with none of its files yet, and a way to
    write them one by one (as fresh files, like the job's writer)."""
    source = iter_dir(trained, 4)
    target = tmp_path / "checkpoints" / "iter_0000004"
    target.mkdir(parents=True)

    def write(name: str) -> None:
        shutil.copyfile(source / name, target / name)

    return source, target, write


def test_files_read_while_the_save_goes_on_give_the_verdict_without_a_second_read(saving, options):
    source, target, write = saving
    options = replace(options, settle_seconds=0, writes_integrity_json=True)
    prescan = Prescan(target, 0, options.hashing, sha256=True)
    write(DATA[0])
    assert prescan.step() == [DATA[0]]
    assert prescan.step() == []  # read once
    # Read, but never judged: no metadata.json yet.
    assert verify_and_record_here(target, options, prescan=prescan).state is State.IN_PROGRESS
    write(DATA[1])
    for name in ("common.pt", ".metadata", "integrity.json", "metadata.json"):
        if (source / name).exists():
            write(name)
    result = verify_and_record_here(target, options, prescan=prescan)
    assert result.ok, result.reason
    assert result.read_early == [DATA[0]]  # the second came after the last step: read at the end
    plain = verify_and_record_here(
        iter_dir(shutil.copytree(target.parent, target.parent.with_name("c")), 4), options
    )
    assert plain.manifest.files == result.manifest.files


def test_the_wait_reads_settled_files_and_leaves_fresh_ones(saving, options):
    _, target, write = saving
    for name in DATA:
        write(name)
    fresh = Prescan(target, 3600, options.hashing)
    assert wait_until_complete(target, options, 0.3, 0.1, fresh.step).state is State.IN_PROGRESS
    assert fresh.read == {}  # just written: not settled for an hour
    settled = Prescan(target, 0, options.hashing)
    wait_until_complete(target, options, 0.3, 0.1, settled.step)
    assert sorted(settled.read) == DATA


def test_a_file_rewritten_after_its_early_reading_is_read_again(saving, options):
    source, target, write = saving
    options = replace(options, settle_seconds=0, writes_integrity_json=True)
    for name in DATA:
        write(name)
    prescan = Prescan(target, 0, options.hashing, sha256=True)
    assert prescan.step() == DATA
    # The writer rewrites the first file (a retry of its save) with a damaged byte.
    data = bytearray((target / DATA[0]).read_bytes())
    records = build_index(load_dcp_metadata(source / ".metadata")).files[DATA[0]]
    data[records[-1].offset + records[-1].length // 2] ^= 1
    (target / DATA[0]).write_bytes(bytes(data))
    os.utime(target / DATA[0], ns=(0, (target / DATA[1]).stat().st_mtime_ns + 10**9))
    for name in ("common.pt", ".metadata", "integrity.json", "metadata.json"):
        if (source / name).exists():
            write(name)
    result = verify_and_record_here(target, options, prescan=prescan)
    assert result.read_early == [DATA[1]]
    assert result.state is State.INVALID and result.reason.startswith(f"{DATA[0]}: ")


def test_overlap_needs_the_local_engine(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("job: {name: j, save_dir: /x}\nverify: {overlap_save: true, engine: slurm}\n")
    with pytest.raises(UsageError, match="overlap_save reads on the verifying host: it needs engine local"):
        load_profile(Path(path))
