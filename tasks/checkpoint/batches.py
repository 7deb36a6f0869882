"""The global batch a checkpoint's run trains on next, from what is on disk alone.

A job on Megatron's ``GPTDataset`` with ``--data-cache-path`` keeps the dataset's index files
there (``<hash>-GPTDataset-train-{description.txt, document_index.npy, sample_index.npy,
shuffle_index.npy}``). Megatron-LM's pretraining sampler (``dataloader_type: single``) serves
the dataset in order from the consumed samples on, so the global batch after a checkpoint is the
dataset's positions ``consumed .. consumed + global batch - 1``; position ``p`` is the dataset's
sample ``shuffle_index[p]``, whose tokens run from ``sample_index[s]`` (document-index entry and
token offset) to ``sample_index[s + 1]``, and ``document_index`` turns entries into documents.
The same arithmetic as ``GPTDataset._query_document_sample_shuffle_indices``, done on the index
files (``numpy.load`` of plain arrays, no pickles, memory-mapped), with no megatron import and no
tokenizer.

The index files are found by their description (the dataset path, seed, sequence length and
split of the checkpoint's args, and the samples the run asks for); their SHA-256s are the data
version, so a resume over rebuilt indices shows.
"""

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tasks.checkpoint import layout
from tasks.checkpoint.dcp import build_index, load_common_state, load_dcp_metadata
from tasks.errors import UsageError

_DESCRIPTION = "-GPTDataset-train-description.txt"
_INDICES = ("document_index", "sample_index", "shuffle_index")


@dataclass
class Sample:
    position: int  # in the order the sampler serves the dataset: consumed samples + k
    sample: int  # the dataset's own sample number (shuffle_index[position])
    documents: list[int]  # the documents its tokens come from, in order
    first_offset: int  # token offset of its start in the first document
    end_offset: int  # token offset of its end in the last document (one extra token is read past it)


@dataclass
class NextBatch:
    checkpoint: str
    iteration: int
    consumed: int
    global_batch_size: int
    description: str  # the index files' description file
    data_version: dict[str, str] = field(default_factory=dict)  # index file -> sha256
    samples: list[Sample] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _train_samples(args) -> int | None:
    if getattr(args, "train_samples", None):
        return int(args.train_samples)
    if getattr(args, "train_iters", None) and getattr(args, "global_batch_size", None):
        return int(args.train_iters) * int(args.global_batch_size)
    return None


def _supported(args, where: Path) -> None:
    """One line naming what this checkpoint's job does that the computation does not cover."""
    if getattr(args, "mock_data", False):
        raise UsageError(f"{where}: the job trains on mock data: it has no dataset indices")
    if getattr(args, "dataloader_type", "single") != "single":
        raise UsageError(
            f"{where}: --dataloader-type {args.dataloader_type}: only Megatron-LM's sequential "
            "pretraining sampler (single) serves the dataset in index order"
        )
    paths = getattr(args, "data_path", None) or []
    if getattr(args, "train_data_path", None) or getattr(args, "per_split_data_args_path", None):
        raise UsageError(f"{where}: per-split data paths are not covered yet; only --data-path with --split")
    if len(paths) != 1:
        raise UsageError(
            f"{where}: --data-path {' '.join(map(str, paths)) or '(none)'}: a blend of several datasets "
            "is not covered yet; only a single dataset"
        )


def find_indices(cache: Path, args, where: Path) -> Path:
    """The description file of the train indices built for this job's dataset and settings."""
    try:
        candidates = sorted(cache.glob(f"*{_DESCRIPTION}"))
    except OSError as e:
        raise UsageError(f"{cache}: the data cache cannot be read ({e.strerror})") from None
    wanted = {
        "dataset_path": str(args.data_path[0]),
        "random_seed": getattr(args, "seed", None),
        "sequence_length": getattr(args, "seq_length", None),
        "split": getattr(args, "split", None),
    }
    matching = []
    for path in candidates:
        try:
            described = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"{path}: unreadable dataset description ({e})") from None
        if all(described.get(k) == v for k, v in wanted.items()):
            matching.append((described.get("num_samples"), path))
    if not matching:
        said = ", ".join(f"{k} {v}" for k, v in wanted.items())
        raise UsageError(f"{where}: no GPTDataset train indices in {cache} for {said}")
    samples = _train_samples(args)
    exact = [p for n, p in matching if n == samples]
    if len(exact) == 1:
        return exact[0]
    if len(matching) == 1:
        return matching[0][1]
    raise UsageError(
        f"{where}: {len(matching)} sets of train indices in {cache} fit the job, none for its "
        f"{samples} train samples: {', '.join(p.name for _, p in matching)}"
    )


def _index_files(description: Path) -> dict[str, Path]:
    """The three index files beside a description file, by index name."""
    stem = str(description)[: -len("description.txt")]
    return {name: Path(f"{stem}{name}.npy") for name in _INDICES}


def _load(description: Path) -> dict[str, np.ndarray]:
    found = {}
    for name, path in _index_files(description).items():
        try:
            found[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise UsageError(f"{path}: unreadable dataset index ({e})") from None
    return found


def batch_samples(indices: dict[str, np.ndarray], consumed: int, count: int) -> list[Sample]:
    """The samples at positions ``consumed .. consumed + count - 1`` of the dataset's order."""
    shuffle, sample_index, document_index = (
        indices["shuffle_index"],
        indices["sample_index"],
        indices["document_index"],
    )
    if consumed + count > len(shuffle):
        raise UsageError(
            f"the batch after {consumed} samples runs past the dataset's {len(shuffle)} samples: "
            "the run's last batch, or indices built for fewer samples"
        )
    found = []
    for position in range(consumed, consumed + count):
        s = int(shuffle[position])
        (begin, first), (end, last) = sample_index[s], sample_index[s + 1]
        documents = [int(d) for d in document_index[int(begin) : int(end) + 1]]
        found.append(Sample(position, s, documents, int(first), int(last)))
    return found


def next_batch(directory: Path, cache: Path | None = None) -> NextBatch:
    """The global batch the run of checkpoint ``directory`` trains on after it, from its args
    and the dataset's index files in ``cache`` (default: the job's own ``--data-cache-path``)."""
    directory = Path(directory)
    if layout.parse_iter_dir(directory.name) is None or not directory.is_dir():
        raise UsageError(f"{directory}: not a checkpoint directory (expected iter_NNNNNNN)")
    common = load_common_state(directory, build_index(load_dcp_metadata(directory / layout.DCP_METADATA)))
    args = common.get("args")
    if args is None:
        raise UsageError(f"{directory}: no args in its common state: the data order cannot be computed")
    _supported(args, directory)
    cache = Path(cache or getattr(args, "data_cache_path", None) or "")
    if not str(cache) or not cache.is_dir():
        raise UsageError(
            f"{directory}: no data cache to read (the job ran without --data-cache-path, or {cache} "
            "is not a folder here): give --data-cache-path"
        )
    description = find_indices(cache, args, directory)
    consumed, size = int(args.consumed_train_samples), int(args.global_batch_size)
    samples = batch_samples(_load(description), consumed, size)
    version = _index_digests(description)
    return NextBatch(
        str(directory), int(common["iteration"]), consumed, size, str(description), version, samples
    )


def _index_digests(description: Path, known: dict | None = None) -> dict[str, dict]:
    """SHA-256, size and mtime of the description and index files; a file whose size and mtime
    ``known`` has (an earlier record of the same files) keeps its digest there, unread."""
    found = {}
    for path in [description, *_index_files(description).values()]:
        try:
            stat = path.stat()
            earlier = (known or {}).get(path.name)
            if earlier and (earlier["size"], earlier["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns):
                digest = earlier["sha256"]
            else:
                with open(path, "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as e:
            raise UsageError(f"{path}: the dataset index cannot be read ({e.strerror})") from None
        found[path.name] = {"sha256": digest, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return found


def data_version(args, where: Path, known: dict | None = None) -> dict:
    """What data a checkpoint's run trains on, for its manifest: the dataset or blend and the
    settings that order it (``blend`` is their SHA-256), and the train indices' files in its
    data cache with their SHA-256s (``indices``; a file ``known``, an earlier record, has with
    the same size and mtime is not read again). Where the indices cannot be found, ``note``
    says why, and ``indices`` is None."""
    dataset = {
        "data_path": [str(p) for p in getattr(args, "data_path", None) or []],
        "split": getattr(args, "split", None),
        "seed": getattr(args, "seed", None),
        "seq_length": getattr(args, "seq_length", None),
        "mock_data": bool(getattr(args, "mock_data", False)),
    }
    blend = hashlib.sha256(json.dumps(dataset, sort_keys=True).encode()).hexdigest()
    cache = getattr(args, "data_cache_path", None)
    version = {"blend": blend, "dataset": dataset, "cache": cache and str(cache), "indices": None}
    try:
        _supported(args, where)
        if not cache or not Path(cache).is_dir():
            why = cache or "the job ran without --data-cache-path"
            raise UsageError(f"{where}: no data cache here ({why})")
        description = find_indices(Path(cache), args, where)
        version["indices"] = _index_digests(description, (known or {}).get("indices"))
    except UsageError as e:
        version["note"] = str(e)
    return version


def changed_indices(recorded: dict) -> list[str]:
    """The recorded index files (``data_version``'s) whose bytes are not those recorded now:
    each named with what changed; read again whatever their size and mtime say."""
    changed = []
    for name, was in (recorded.get("indices") or {}).items():
        path = Path(recorded["cache"]) / name
        try:
            with open(path, "rb") as f:
                now = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as e:
            changed.append(f"{name}: {e.strerror}")
            continue
        if now != was["sha256"]:
            changed.append(f"{name}: sha256 {now[:12]}, recorded {was['sha256'][:12]}")
    return changed
