"""A checkpoint's own files as a hostile or unlucky writer leaves them: each is read bounded
(``tasks.storage.bounded``'s policy), and a violation makes that checkpoint invalid in one line
naming the file and the limit, never a hang, a traceback or a read outside the checkpoint."""

import dataclasses
import os
import pickle
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest

from tasks.checkpoint import dialect
from tasks.checkpoint.dcp import Record, build_index, load_dcp_metadata, read_record
from tasks.checkpoint.manifest import read_manifest
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.promote import promote
from tasks.checkpoint.state import State, completeness
from tasks.checkpoint.verify import verify_checkpoint
from tasks.errors import CkptopsError
from tests.conftest import iter_dir, verify_and_record_here


def copied(trained: Path, tmp_path: Path, *iterations: int) -> Path:
    """A save directory holding copies of these checkpoints of the trained run (mtimes kept)."""
    save = tmp_path / "checkpoints"
    for iteration in iterations:
        shutil.copytree(iter_dir(trained, iteration), iter_dir(save, iteration))
    return save


def rewrite_index(directory: Path, change) -> None:
    """``.metadata`` unpickled, changed by ``change`` and pickled again, as a writer could."""
    metadata = load_dcp_metadata(directory / ".metadata")
    change(metadata)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


class Feeder:
    """The writer a reader blocked on a FIFO waits for: once one opens it, it writes bytes that
    are not an index and closes, so a reader that opened the FIFO ends (with a garbled index)
    instead of hanging the test; ``close`` releases it if nobody did."""

    def __init__(self, fifo: Path):
        self.fifo = fifo
        self.thread = threading.Thread(target=self._feed, daemon=True)
        self.thread.start()

    def _feed(self) -> None:
        try:
            fd = os.open(self.fifo, os.O_WRONLY)
            try:
                os.write(fd, b"not an index")
            finally:
                os.close(fd)
        except OSError:
            pass  # the reader had gone: nothing to feed

    def close(self) -> None:
        os.close(os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK))
        self.thread.join()


def fifo_index(directory: Path) -> Feeder:
    (directory / ".metadata").unlink()
    os.mkfifo(directory / ".metadata")
    return Feeder(directory / ".metadata")


def test_a_fifo_at_metadata_is_refused_not_waited_on(trained, tmp_path, options):
    directory = iter_dir(copied(trained, tmp_path, 8), 8)
    feeder = fifo_index(directory)
    try:
        result = verify_checkpoint(directory, options)
    finally:
        feeder.close()
    assert result.state is State.INVALID
    assert result.reason.startswith(".metadata: a FIFO, not a regular file; refused [dcp-metadata]")


def test_promotion_passes_over_a_fifo_index_to_the_valid_checkpoint_before_it(trained, tmp_path, options):
    save = copied(trained, tmp_path, 4, 8)
    feeder = fifo_index(iter_dir(save, 8))
    try:
        report = promote(save, options, 30)
    finally:
        feeder.close()
    assert read_pointer(save) == 4
    assert [(v.iteration, v.state) for v in report.verifications] == [(4, State.VALID), (8, State.INVALID)]
    assert "a FIFO, not a regular file; refused" in report.verifications[1].reason


def test_a_record_leading_out_of_the_checkpoint_is_refused_and_never_read(trained, tmp_path, options):
    """The common state's record names ``../../x``, where a copy of its data file lies: before,
    it was read there (and unpickled); now the index is refused naming the record."""
    directory = iter_dir(copied(trained, tmp_path, 8), 8)
    index = build_index(load_dcp_metadata(directory / ".metadata"))
    common = index.records[("common_state/shard_0_1", None)]
    shutil.copy(directory / common.file, tmp_path / "x")

    def outward(metadata):
        for key, info in metadata.storage_data.items():
            if key.fqn == "common_state/shard_0_1":
                metadata.storage_data[key] = dataclasses.replace(info, relative_path="../../x")

    rewrite_index(directory, outward)
    result = verify_checkpoint(directory, options)
    assert result.state is State.INVALID
    assert result.reason.startswith(
        ".metadata: record 'common_state/shard_0_1' names the file '../../x', not a data file in the "
        "checkpoint directory; refused [dcp-metadata]"
    )
    with pytest.raises(CkptopsError, match="lies outside the checkpoint"):
        read_record(directory, Record("common_state/shard_0_1", "../../x", common.offset, common.length))


def test_a_chunk_bomb_is_refused_by_the_tensors_elements(trained, tmp_path, options):
    """A tensor with 200,000 chunks (one chunk's object referenced again and again: a few bytes
    each in the pickle): refused by its element count before any chunk is walked."""
    directory = iter_dir(copied(trained, tmp_path, 8), 8)
    metadata = load_dcp_metadata(directory / ".metadata")
    name, item = min(
        ((k, v) for k, v in metadata.state_dict_metadata.items() if getattr(v, "chunks", None)),
        key=lambda kv: kv[1].size.numel(),
    )
    elements = item.size.numel()

    def bomb(metadata):
        metadata.state_dict_metadata[name].chunks = [item.chunks[0]] * 200_000

    rewrite_index(directory, bomb)
    assert (directory / ".metadata").stat().st_size < 2 << 20  # within the size limit: unpickled
    result = verify_checkpoint(directory, options)
    assert result.state is State.INVALID
    assert result.reason.startswith(
        f".metadata: tensor '{name}' has 200,000 chunks, more than its {elements:,} elements; refused"
    )


def test_an_index_larger_than_its_data_files_allow_is_refused_unread(trained, tmp_path, options):
    """A chunk bomb of millions of chunks: refused by its size, before it is unpickled."""
    directory = iter_dir(copied(trained, tmp_path, 8), 8)
    metadata = load_dcp_metadata(directory / ".metadata")
    name, item = next((k, v) for k, v in metadata.state_dict_metadata.items() if getattr(v, "chunks", None))

    def bomb(metadata):
        metadata.state_dict_metadata[name].chunks = [item.chunks[0]] * 3_000_000

    rewrite_index(directory, bomb)
    size = (directory / ".metadata").stat().st_size
    data = sum(p.stat().st_size for p in directory.glob("*.distcp"))
    result = verify_checkpoint(directory, options)
    assert result.state is State.INVALID
    assert result.reason.startswith(
        f".metadata: {size:,} bytes, more than the {data + (1 << 20):,} the data files beside it allow "
        "(their size and 1 MiB); refused [dcp-metadata]"
    )


def test_a_stray_run_config_does_not_make_a_megatron_lm_checkpoint_bridge(trained, tmp_path, options):
    """Its own args say Megatron-LM: a run_config.yaml beside them neither makes it a Bridge save
    still finishing (in progress for ever) nor asks Bridge's files of it."""
    directory = iter_dir(copied(trained, tmp_path, 8), 8)
    (directory / dialect.RUN_CONFIG).write_text("model:\n  num_layers: 2\n")
    assert dialect.dialect_of(directory) == dialect.MEGATRON_LM
    assert completeness(directory, options).state is None
    result = verify_checkpoint(directory, options)
    assert result.state is State.VALID, result.reason


def test_megatron_lm_args_decide_even_beside_bridge_files(trained, tmp_path, options):
    """A train_state.pt and run_config.yaml planted beside Megatron-LM's args: the args decide
    which rules apply, not the files."""
    import torch

    directory = iter_dir(copied(trained, tmp_path, 8), 8)
    torch.save(
        {"step": torch.tensor(3), "consumed_train_samples": torch.tensor(1)}, directory / "train_state.pt"
    )
    (directory / dialect.RUN_CONFIG).write_text("model:\n  num_layers: 2\n")
    result = verify_checkpoint(directory, options)
    assert result.state is State.VALID, result.reason


def _deep(path: Path, depth: int = 5000) -> None:
    path.write_text("[" * depth + "]" * depth)


def test_a_deep_run_config_is_one_line_naming_it(tmp_path):
    _deep(tmp_path / dialect.RUN_CONFIG)
    with pytest.raises(CkptopsError, match=r"run_config\.yaml: .* nests deeper than 64 levels; refused"):
        dialect.run_config(tmp_path / dialect.RUN_CONFIG)


def test_a_deep_run_config_leaves_completeness_to_verification(tmp_path, options):
    """A Bridge save (its train state there) whose run_config.yaml nests thousands deep: the
    stat-level judgement, which status, promotion and verify all ask first, does not fail on it."""
    directory = tmp_path / "checkpoints" / "iter_0000008"
    directory.mkdir(parents=True)
    (directory / "metadata.json").write_text(
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
    )
    (directory / "train_state.pt").write_bytes(b"not read here")
    _deep(directory / dialect.RUN_CONFIG)
    assert completeness(directory, options).state is None


def test_lineage_not_checked_is_said_when_an_earlier_checkpoint_is_not_verified(trained, tmp_path, options):
    """8 verified before 4: its lineage had nothing to be compared with, and its verdict says so
    instead of "all checks passed"."""
    save = copied(trained, tmp_path, 4, 8)
    result = verify_and_record_here(iter_dir(save, 8), options)
    lineage = next(c for c in result.checks if c.name == "lineage")
    assert result.ok and lineage.outcome.value == "warn"
    said = "lineage not checked: no earlier verified checkpoint (iteration 4 is not verified valid)"
    assert lineage.detail == said
    assert result.line() == f"VALID iter_0000008: {said} [lineage]; every other check passed"
    first = verify_and_record_here(iter_dir(save, 4), options)
    assert first.line() == "VALID iter_0000004: all checks passed"
    judged = read_manifest(iter_dir(save, 8))  # judged again against 4, from the manifests
    assert judged.reason == "all checks passed" and judged.lineage_from == 4


def test_a_deep_integrity_json_fails_its_check_in_one_line(trained, tmp_path, options):
    """Megatron's integrity.json nested thousands deep: before, JSON's RecursionError escaped
    verification as a traceback."""
    directory = iter_dir(copied(trained, tmp_path, 8), 8)
    _deep(directory / "integrity.json")
    settled = time.time() - 2 * options.settle_seconds  # written by a save that finished a while ago
    os.utime(directory / "integrity.json", (settled, settled))
    result = verify_checkpoint(directory, options)
    assert result.state is State.INVALID
    assert result.reason.startswith(
        "integrity.json: unreadable (nests deeper than 64 levels; refused) [integrity.json]"
    )


def _torch_dcp_save(directory: Path, state: dict) -> None:
    """``state`` saved by torch's own DCP writer in this one process (no process group)."""
    import torch.distributed.checkpoint as torch_dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        torch_dcp.save(state, checkpoint_id=str(directory))


def test_a_torch_dcp_save_with_a_scalar_tensor_loads_and_checks(tmp_path):
    """A 0-dim tensor's one chunk has no offsets and no sizes; the index of a plain torch DCP save
    (its checkpoint_id a pathlib path) holding one loads, and both tensors have their records."""
    import torch

    _torch_dcp_save(tmp_path, {"scalar": torch.tensor(3.0), "weight": torch.ones(2, 3)})
    index = build_index(load_dcp_metadata(tmp_path / ".metadata"))
    assert set(index.tensors) == {"scalar", "weight"}
    assert {record.key for record in index.records.values()} == {"scalar@[]", "weight@[0, 0]"}


@pytest.mark.parametrize("chunks", [0, 1], ids=["no-chunk", "a-chunk-with-offsets"])
def test_a_scalar_tensor_not_of_one_empty_chunk_is_refused(tmp_path, chunks):
    """No chunk, or its one chunk with an offset and a size (a second chunk is past its one
    element already): refused in one line naming the tensor."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _torch_dcp_save(tmp_path, {"scalar": torch.tensor(3.0)})

    def change(metadata):
        item = metadata.state_dict_metadata["scalar"]
        item.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))] if chunks else []

    rewrite_index(tmp_path, change)
    with pytest.raises(CkptopsError, match="tensor 'scalar' is a scalar but has not exactly 1 chunk"):
        load_dcp_metadata(tmp_path / ".metadata")
