"""The batch a resume trains on next, computed from a checkpoint and the dataset's index files
(tasks/checkpoint/batches.py), against what Megatron's own GPTDataset and pretraining sampler
serve for it."""

import hashlib
import json
import shutil

import numpy
import pytest

from tasks.checkpoint.batches import next_batch
from tasks.checkpoint.dcp import build_index, load_common_state, load_dcp_metadata
from tasks.checkpoint.facts import checkpoint_facts
from tasks.checkpoint.manifest import read_manifest
from tasks.job.step_records import load_steps
from tasks.profile import load_profile
from tasks.resume.checks import Validator
from tests.conftest import iter_dir, verify_and_record_here
from tests.test_cli import ckptops_here
from tests.test_continuation import by_name


def served_by_megatron(checkpoint) -> tuple[list[int], dict[int, list[int]]]:
    """The positions Megatron-LM's pretraining sampler serves for the global batch after the
    checkpoint (every data-parallel rank, every micro-batch), and the documents GPTDataset reads
    for each: the dataset built as the job built it, from the same data cache."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    from infra.local_job.dataset import datasets

    args = load_common_state(checkpoint, build_index(load_dcp_metadata(checkpoint / ".metadata")))["args"]
    samples = [args.train_iters * args.global_batch_size, 0, 0]  # no evaluation, as the job ran
    train, _, _ = datasets(args, build_tokenizer(args), samples)
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    ranks = [
        iter(MegatronPretrainingSampler(len(train), args.consumed_train_samples, mbs, rank, dp))
        for rank in range(dp)
    ]
    positions = []
    for _ in range(args.global_batch_size // (mbs * dp)):
        for rank in ranks:
            positions += next(rank)
    return positions, {p: documents_of(train, p) for p in positions}


def documents_of(train, position: int) -> tuple[int, list[int]]:
    """Which dataset of a blend (0 without one) and which of its documents serve ``position``,
    as Megatron's own datasets look them up."""
    from megatron.core.datasets.blended_dataset import BlendedDataset

    dataset = 0
    if isinstance(train, BlendedDataset):
        dataset = int(train.dataset_index[position])
        train, position = train.datasets[dataset], int(train.dataset_sample_index[position])
    return dataset, [int(d) for d in train._query_document_sample_shuffle_indices(position)[1]]


@pytest.mark.parametrize("iteration", [4, 8])
def test_the_next_batch_is_what_megatrons_dataset_and_sampler_serve(on_indexed_data, iteration):
    save, cache = on_indexed_data
    checkpoint = iter_dir(save, iteration)
    batch = next_batch(checkpoint)
    positions, documents = served_by_megatron(checkpoint)
    assert batch.consumed == 8 * iteration and batch.global_batch_size == 8
    assert [s.position for s in batch.samples] == sorted(positions)
    assert {s.position: (s.dataset, s.documents) for s in batch.samples} == documents
    assert len({s.sample for s in batch.samples}) == 8  # eight different samples of the shuffle
    assert sorted(batch.data_version) == sorted(p.name for p in cache.glob("*-GPTDataset-train-*"))


def test_the_next_batch_of_a_blend_is_what_megatrons_blended_dataset_serves(
    on_blended_data, tmp_path, options
):
    save, cache = on_blended_data
    checkpoint = iter_dir(save, 4)
    batch = next_batch(checkpoint)
    positions, documents = served_by_megatron(checkpoint)
    assert [s.position for s in batch.samples] == sorted(positions)
    assert {s.position: (s.dataset, s.documents) for s in batch.samples} == documents
    assert {s.dataset for s in batch.samples} == {0, 1}  # both datasets serve this batch
    # The data version holds the blend's indices and each dataset's.
    kinds = sorted(name.split("-", 1)[1] for name in batch.data_version)
    assert kinds.count("GPTDataset-train-shuffle_index.npy") == 2
    assert "BlendedDataset-train-dataset_index.npy" in kinds
    copy = shutil.copytree(save, tmp_path / "checkpoints")
    recorded = verify_and_record_here(iter_dir(copy, 4), options).manifest.data_version
    assert recorded["indices"] == batch.data_version and recorded["dataset"]["data_path"][0] == "0.3"


def test_the_cli_prints_the_batch_and_says_in_one_line_what_it_cannot_compute(
    on_indexed_data, trained, tmp_path
):
    save, cache = on_indexed_data
    checkpoint = iter_dir(save, 4)
    shown = ckptops_here("next-batch", checkpoint, "--json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["samples"][0]["position"] == 32

    # The job's cache is gone from this host: given elsewhere, the same batch.
    moved = shutil.copytree(cache, tmp_path / "cache")
    elsewhere = ckptops_here("next-batch", checkpoint, "--data-cache-path", moved, "--json")
    assert json.loads(elsewhere.stdout)["samples"] == json.loads(shown.stdout)["samples"]

    # Two sets of indices for the dataset, neither built for the job's 96 samples: which one
    # the run read cannot be told.
    for index in list(moved.glob("*")):
        shutil.copy(index, moved / index.name.replace(index.name[:32], "0" * 32))
    for description in moved.glob("*-description.txt"):
        text = json.loads(description.read_text())
        description.write_text(json.dumps(text | {"num_samples": 7}))
    both = ckptops_here("next-batch", checkpoint, "--data-cache-path", moved)
    assert both.exit_code == 2
    assert both.stderr.strip().endswith(
        "none for its 96 train samples: " + ", ".join(sorted(p.name for p in moved.glob("*-description.txt")))
    )

    mock = ckptops_here("next-batch", iter_dir(trained, 4))
    assert mock.exit_code == 2
    assert (
        mock.stderr.strip()
        == f"ckptops: {iter_dir(trained, 4)}: the job trains on mock data: it has no dataset indices"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = ckptops_here("next-batch", checkpoint, "--data-cache-path", empty)
    assert nothing.exit_code == 2 and f"no GPTDataset train indices in {empty}" in nothing.stderr


def test_the_manifest_records_the_data_version_and_a_resume_over_changed_indices_fails(
    on_indexed_data, tmp_path, options
):
    trained, cache = on_indexed_data
    save = shutil.copytree(trained, tmp_path / "checkpoints")
    for iteration in (4, 8):
        verify_and_record_here(iter_dir(save, iteration), options)
    recorded = read_manifest(iter_dir(save, 8)).data_version
    assert recorded["dataset"]["data_path"] == [str(cache.parent / "tokens")] and recorded["cache"] == str(
        cache
    )
    for name, entry in recorded["indices"].items():
        assert entry["sha256"] == hashlib.sha256((cache / name).read_bytes()).hexdigest()
    assert recorded["blend"] == read_manifest(iter_dir(save, 4)).data_version["blend"]

    # Post-resume validation: the indices as recorded, and the batch after the checkpoint named.
    log = load_steps(trained.parent / f"{trained.name}-train.log")
    facts = checkpoint_facts(iter_dir(save, 8))
    settings = load_profile().resume
    check = by_name(Validator(facts, log, log, settings, None).run())["data version"]
    batch = next_batch(iter_dir(save, 8))
    assert check.outcome.value == "pass" and check.detail.endswith(
        "the batch after it: dataset samples " + ", ".join(str(s.sample) for s in batch.samples)
    )

    # The job's cache rebuilt under it (here: a copy whose shuffle changed): the same position
    # would serve other samples.
    moved = shutil.copytree(cache, tmp_path / "cache")
    facts.data_version = recorded | {"cache": str(moved)}
    (shuffle,) = moved.glob("*-train-shuffle_index.npy")
    numpy.save(shuffle, numpy.load(shuffle)[::-1].copy())
    check = by_name(Validator(facts, log, log, settings, None).run())["data version"]
    assert check.outcome.value == "fail" and check.observed.startswith(f"{shuffle.name}: sha256 ")
