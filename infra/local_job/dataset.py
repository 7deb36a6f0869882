"""A small real dataset for the local job, written once with megatron-core's
``IndexedDatasetBuilder`` (``PREFIX.bin`` and ``PREFIX.idx``, the format Megatron-LM's
preprocessing writes), for training through the real ``GPTDataset``:

    python -m infra.local_job.dataset PREFIX [--documents N]
    pretrain.py ... --data-path PREFIX --data-cache-path DIR --split 100,0,0

With ``--data-cache-path`` the dataset's document, sample and shuffle index files are written
there on the first run and read back by every later one, as on a cluster.

The documents are arithmetic token sequences of varied length (learnable, so a loss curve means
something), drawn from a seed: the same prefix holds the same tokens on every machine.
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np


def build(prefix: Path, documents: int = 2000, vocab_size: int = 128, seed: int = 4321) -> Path:
    """Write ``prefix``.bin/.idx unless both exist (then they are used as they are, whatever
    they were built with); the prefix. Each file is written under a temporary name and renamed,
    so a reader never sees half of one."""
    prefix = Path(prefix)
    bin_path, idx_path = prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")
    if bin_path.exists() and idx_path.exists():
        return prefix
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    part = f".{os.getpid()}.part"
    builder = IndexedDatasetBuilder(str(bin_path) + part, dtype=DType.optimal_dtype(vocab_size))
    rng = np.random.default_rng(seed)
    for _ in range(documents):
        length = int(rng.integers(16, 97))
        start, step = rng.integers(0, vocab_size - 1, 2)
        tokens = (start + step * np.arange(length)) % (vocab_size - 1)
        builder.add_document(torch.from_numpy(tokens), [length])
    builder.finalize(str(idx_path) + part)
    os.replace(str(bin_path) + part, bin_path)
    os.replace(str(idx_path) + part, idx_path)
    return prefix


def datasets(args, tokenizer, train_val_test_num_samples):
    """Megatron-LM's train, valid and test datasets for ``args`` (a job's, or a checkpoint's
    saved ones): GPTDataset over the job's data, or MockGPTDataset over fewer mock documents, as
    the local job builds them."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    kind = _small_mock(MockGPTDataset) if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(kind, train_val_test_num_samples, lambda: True, config).build()


# Megatron's mock documents, fewer and shorter: its own 100,000 documents of up to 4,096 tokens are
# 6.4 million samples of the tiny job's 32 tokens, which every rank shuffles at start-up (about
# 0.5 CPU-s of a rank's 2); 4,000 of up to 512 tokens are about 32,000 samples, a hundred times
# what the longest local run reads.
MOCK_DOCUMENTS = 4000
MOCK_MAX_LENGTH = 512


def _small_mock(mock_dataset: type) -> type:
    """``MockGPTDataset`` over ``MOCK_DOCUMENTS`` of Megatron's mock documents (its own low-level
    mock dataset, with its seed and token pattern)."""
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    class Documents(MockGPTLowLevelDataset):
        size = MOCK_DOCUMENTS
        max_sequence_length = MOCK_MAX_LENGTH

    class SmallMockGPTDataset(mock_dataset):
        @staticmethod
        def build_low_level_dataset(dataset_path, config):
            return Documents(config.tokenizer)

    return SmallMockGPTDataset


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prefix", type=Path, help="where PREFIX.bin and PREFIX.idx go")
    p.add_argument("--documents", type=int, default=2000)
    p.add_argument("--vocab-size", type=int, default=128, help="the job's --vocab-size")
    p.add_argument("--seed", type=int, default=4321)
    args = p.parse_args(argv)
    print(build(args.prefix, args.documents, args.vocab_size, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
