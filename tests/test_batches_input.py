"""The dataset's description and index files are the job's, or anyone's who can write its data
cache: whatever they hold, ``next-batch``, verification and promotion say what is wrong in one
line, and a cache that cannot be read now is read again later, not frozen into the manifest."""

import json
import os
import shutil
import subprocess

import numpy
import pytest

from tasks.checkpoint.batches import _Indices, _read_description, data_version
from tasks.checkpoint.dcp import build_index, load_common_state, load_dcp_metadata
from tasks.checkpoint.manifest import read_manifest
from tasks.errors import UsageError
from tests.conftest import ROOT, iter_dir
from tests.test_cli import ckptops_here

CKPTOPS = ROOT / ".venv" / "bin" / "ckptops"


def one_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_next_batch_refuses_a_description_or_index_entry_it_cannot_use_in_one_line(on_indexed_data, tmp_path):
    save, cache = on_indexed_data
    checkpoint = iter_dir(save, 4)  # 32 samples consumed, a global batch of 8
    moved = shutil.copytree(cache, tmp_path / "cache")
    (shuffle,) = moved.glob("*-train-shuffle_index.npy")
    (sample_index,) = moved.glob("*-train-sample_index.npy")
    order = numpy.load(shuffle)
    samples = len(numpy.load(sample_index)) - 1
    for value in (-1, samples, 2**40):
        changed = order.astype(numpy.int64)  # a negative entry needs a signed type
        changed[33] = value
        numpy.save(shuffle, changed)
        line = one_line(ckptops_here("next-batch", checkpoint, "--data-cache-path", moved))
        outside = f"entry 33 is {value}, outside 0..{samples - 1}: the index does not fit the others"
        assert line == f"ckptops: {shuffle}: {outside}"
    numpy.save(shuffle, order)
    assert ckptops_here("next-batch", checkpoint, "--data-cache-path", moved).exit_code == 0

    (description,) = moved.glob("*-description.txt")
    description.write_text(json.dumps([json.loads(description.read_text())]))
    line = one_line(ckptops_here("next-batch", checkpoint, "--data-cache-path", moved))
    assert line == f"ckptops: {description}: not a dataset description (a JSON list, not an object)"


def test_an_unreadable_index_is_a_transient_note_read_again_by_the_next_verification(
    on_indexed_data, tmp_path
):
    save, cache = on_indexed_data
    # The newest checkpoint alone: promotion verifies one.
    older = shutil.ignore_patterns("iter_0000004", "iter_0000008")
    copy = shutil.copytree(save, tmp_path / "checkpoints", ignore=older)
    profile = tmp_path / "p.yaml"
    profile.write_text(
        json.dumps(
            {
                "job": {
                    "name": "test",
                    "save_dir": str(copy),
                    "megatron_core_version": "0.19.2",
                    "layout": {"data_parallel": 2},
                }
            }
        )
    )

    # On a host where the job's cache holds a description that is a JSON list: promoted, and
    # the manifest says why the indices are not recorded, as a note to read again.
    broken = shutil.copytree(cache, tmp_path / "broken-cache")
    (description,) = broken.glob("*-description.txt")
    description.write_text(json.dumps([json.loads(description.read_text())]))
    promoted = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount --bind "$1" "$2" && exec "$3" promote --profile "$4"',
            "sh",
            broken,
            cache,
            CKPTOPS,
            profile,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    assert "Traceback" not in promoted.stderr
    noted = read_manifest(iter_dir(copy, 12)).data_version
    assert noted["indices"] is None and noted["transient"] is True
    assert (
        noted["note"] == f"{cache / description.name}: not a dataset description (a JSON list, not an object)"
    )

    # Here, with the cache whole: the next verification of the checkpoint reads it again.
    assert ckptops_here("verify", iter_dir(copy, 12), "--profile", profile).exit_code == 0
    recorded = read_manifest(iter_dir(copy, 12)).data_version
    assert "note" not in recorded and "transient" not in recorded
    assert sorted(recorded["indices"]) == sorted(p.name for p in cache.glob("*-GPTDataset-train-*"))

    # An index file the cache holds as a FIFO (a plain open would block): a transient note too.
    fifo = shutil.copytree(cache, tmp_path / "fifo-cache")
    (shuffle,) = fifo.glob("*-train-shuffle_index.npy")
    shuffle.unlink()
    os.mkfifo(shuffle)
    args = load_common_state(
        iter_dir(copy, 12), build_index(load_dcp_metadata(iter_dir(copy, 12) / ".metadata"))
    )["args"]
    args.data_cache_path = str(fifo)
    found = data_version(args, iter_dir(copy, 12))
    assert found["indices"] is None and found["transient"] is True
    assert found["note"] == f"{shuffle}: a FIFO, not a regular file; give the file itself"


def test_next_batch_of_an_empty_or_garbled_checkpoint_folder_names_it_and_what_is_missing(tmp_path):
    """An iteration folder a save left empty (or is still writing): one line naming the folder and
    the file it lacks, exit 2 (it was exit 1 and ``.metadata: missing``, no folder)."""
    empty = tmp_path / "iter_0000004"
    empty.mkdir()
    line = one_line(ckptops_here("next-batch", empty))
    assert line == (
        f"ckptops: {empty}: no .metadata: an empty or unfinished save, or not a torch_dist checkpoint: "
        "its args, and so the data order, cannot be read"
    )
    (empty / ".metadata").write_bytes(b"not a pickle")
    line = one_line(ckptops_here("next-batch", empty))
    assert line.startswith(f"ckptops: {empty}: .metadata: unreadable (") and line.endswith("[dcp-metadata]")


def test_the_data_caches_files_are_read_bounded_never_waited_on(tmp_path):
    """Anyone who can write the data cache can leave a FIFO or a bomb there: numpy's and
    read_text's plain opens waited on a FIFO for ever, and a deep description was a
    RecursionError. Each is one line naming the file, as a description or index is."""
    description = tmp_path / "abc-GPTDataset-train-description.txt"
    os.mkfifo(description)
    with pytest.raises(UsageError) as caught:
        _read_description(description)
    assert str(caught.value) == f"{description}: a FIFO, not a regular file; give the file itself"
    description.unlink()
    description.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UsageError, match=r"abc-GPTDataset-train-description.txt: the dataset description "):
        _read_description(description)

    description.write_text("{}")
    numpy.save(tmp_path / "abc-GPTDataset-train-document_index.npy", numpy.arange(4, dtype=numpy.int32))
    numpy.save(tmp_path / "abc-GPTDataset-train-sample_index.npy", numpy.zeros((3, 2), dtype=numpy.int64))
    shuffle = tmp_path / "abc-GPTDataset-train-shuffle_index.npy"
    os.mkfifo(shuffle)
    with pytest.raises(UsageError) as caught:
        _Indices(description)
    assert str(caught.value) == f"{shuffle}: a FIFO, not a regular file; give the file itself"
    shuffle.unlink()
    numpy.save(shuffle, numpy.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(UsageError) as caught:
        _Indices(description)
    assert str(caught.value) == f"{shuffle}: unreadable dataset index (it holds Python objects)"
    numpy.save(shuffle, numpy.array([1, 0], dtype=numpy.uint32))
    indices = _Indices(description)
    assert indices.arrays["shuffle_index"].tolist() == [1, 0] and len(indices) == 2
    assert indices.arrays["sample_index"].shape == (3, 2) and indices.entry("document_index", 3) == 3
