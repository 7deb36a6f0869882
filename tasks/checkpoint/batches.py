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

A blend (``--data-path W1 P1 W2 P2 ...``) is a ``BlendedDataset`` over one ``GPTDataset`` per
prefix: its own index files (``dataset_index``, ``dataset_sample_index``) say which dataset and
which of its samples serve each position, and its description holds each dataset's identifiers,
whose MD5 names that dataset's index files, as Megatron names them.

The index files are found by their description (the dataset paths, seed, sequence length and
split of the checkpoint's args, and the samples the run asks for); their SHA-256s are the data
version, so a resume over rebuilt indices shows.
"""

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from numpy.lib import format as npy

from tasks.checkpoint import dialect, layout
from tasks.checkpoint.dcp import CheckFailed, build_index, load_common_state, load_dcp_metadata
from tasks.errors import CkptopsError, Malformed, Unreadable, UsageError, unreadable
from tasks.storage.bounded import load_json, read_bounded
from tasks.storage.local import open_regular

# Each kind of train dataset Megatron caches: its description file's suffix and its index files.
_GPT = "GPTDataset"
_BLENDED = "BlendedDataset"
_INDICES = {
    _GPT: ("document_index", "sample_index", "shuffle_index"),
    _BLENDED: ("dataset_index", "dataset_sample_index"),
}


# Megatron's description of one dataset is about a kilobyte; a blend's lists each of its datasets'.
MAX_DESCRIPTION_BYTES = 16 << 20


def _description_suffix(kind: str) -> str:
    return f"-{kind}-train-description.txt"


@dataclass
class Sample:
    position: int  # in the order the sampler serves the dataset: consumed samples + k
    sample: int  # its dataset's own sample number (that dataset's shuffle_index entry)
    dataset: int  # which dataset of a blend serves it (0 without a blend)
    documents: list[int]  # the documents its tokens come from, in order
    first_offset: int  # token offset of its start in the first document
    end_offset: int  # token offset of its end in the last document (one extra token is read past it)


@dataclass
class NextBatch:
    checkpoint: str
    iteration: int
    consumed: int
    global_batch_size: int
    description: str  # the train dataset's description file (the blend's, for a blend)
    data_version: dict[str, dict] = field(default_factory=dict)  # index file -> sha256, size, mtime
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
    if getattr(args, "train_data_path", None) or getattr(args, "per_split_data_args_path", None):
        raise UsageError(f"{where}: per-split data paths are not covered yet; only --data-path with --split")
    if getattr(args, "data_args_path", None):
        raise UsageError(f"{where}: --data-args-path is not covered yet; only --data-path with --split")
    _prefixes(args, where)


def _prefixes(args, where: Path) -> list[str]:
    """The dataset prefixes of ``--data-path``: one prefix, or a blend's ``W1 P1 W2 P2 ...``."""
    paths = [str(p) for p in getattr(args, "data_path", None) or []]
    if len(paths) == 1:
        return paths
    try:
        [float(w) for w in paths[0::2]]
    except ValueError:
        paths = []
    if not paths or len(paths) % 2:
        raise UsageError(
            f"{where}: --data-path {' '.join(paths) or '(none)'}: neither one dataset nor a blend "
            "of weights and prefixes"
        )
    return paths[1::2]


def _read_description(path: Path) -> dict:
    """A description file of the cache, a JSON object read bounded (a regular file of at most
    ``MAX_DESCRIPTION_BYTES``, nested at most ``MAX_DEPTH``); anything else is one line naming it."""
    try:
        what = "the dataset description"
        described = load_json(read_bounded(path, MAX_DESCRIPTION_BYTES, what), path, what)
    except CkptopsError as e:
        raise UsageError(str(e)) from None
    if not isinstance(described, dict):
        raise UsageError(
            f"{path}: not a dataset description (a JSON {type(described).__name__}, not an object)"
        )
    return described


def _blend(described: dict, path: Path) -> tuple[list[dict], list[float]]:
    """A blend's datasets (each one's identifiers) and weights, as its description lists them."""
    members, weights = described.get("datasets"), described.get("weights")
    if (
        not isinstance(members, list)
        or not all(isinstance(m, dict) for m in members)
        or not isinstance(weights, list)
        or not all(isinstance(w, int | float) and not isinstance(w, bool) for w in weights)
    ):
        raise UsageError(
            f"{path}: not a BlendedDataset description (datasets: a list of objects, weights: a "
            "list of numbers)"
        )
    return members, weights


def _pick(matching: list[tuple[int | None, Path]], args, cache: Path, kind: str, where: Path) -> Path:
    """The description built for the job's train samples, or the only one that fits."""
    if not matching:
        raise UsageError(f"{where}: no {kind} train indices in {cache} for {_wanted(args)}")
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


def _wanted(args) -> str:
    return (
        f"dataset {' '.join(str(p) for p in args.data_path)}, random_seed {getattr(args, 'seed', None)}, "
        f"sequence_length {getattr(args, 'seq_length', None)}, split {getattr(args, 'split', None)}"
    )


def _fits(described: dict, args, prefix: str) -> bool:
    wanted = {
        "dataset_path": prefix,
        "random_seed": getattr(args, "seed", None),
        "sequence_length": getattr(args, "seq_length", None),
        "split": getattr(args, "split", None),
    }
    return all(described.get(k) == v for k, v in wanted.items())


def _candidates(cache: Path, kind: str) -> list[Path]:
    try:
        return sorted(cache.glob(f"*{_description_suffix(kind)}"))
    except OSError as e:
        raise UsageError(f"{cache}: the data cache cannot be read ({e.strerror})") from None


def find_indices(cache: Path, args, where: Path) -> list[Path]:
    """The description files of the train indices built for this job's data and settings: the
    dataset's, or the blend's followed by each of its datasets', in the blend's order."""
    prefixes = _prefixes(args, where)
    if len(prefixes) == 1:
        matching = []
        for path in _candidates(cache, _GPT):
            described = _read_description(path)
            if _fits(described, args, prefixes[0]):
                matching.append((described.get("num_samples"), path))
        return [_pick(matching, args, cache, _GPT, where)]
    given = [float(w) for w in args.data_path[0::2]]
    weights = [w / sum(given) for w in given]  # as Megatron normalises them
    matching = []
    for path in _candidates(cache, _BLENDED):
        described = _read_description(path)
        members, described_weights = _blend(described, path)
        if (
            len(members) == len(prefixes) == len(described_weights)
            and all(_fits(m, args, prefix) for m, prefix in zip(members, prefixes))
            and np.allclose(described_weights, weights, rtol=1e-9, atol=0)
        ):
            matching.append((described.get("size"), path))
    blend = _pick(matching, args, cache, _BLENDED, where)
    members = []
    for identifiers in _blend(_read_description(blend), blend)[0]:
        # Megatron names a dataset's files by the MD5 of its description, as it wrote it.
        text = json.dumps(identifiers, indent=4)
        member = (
            cache
            / f"{hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()}{_description_suffix(_GPT)}"
        )
        if not member.is_file():
            raise UsageError(
                f"{blend}: the indices of its dataset {identifiers.get('dataset_path')} are not in {cache}"
            )
        members.append(member)
    return [blend, *members]


def _index_files(description: Path) -> dict[str, Path]:
    """The index files beside a description file, by index name."""
    stem = str(description)[: -len("description.txt")]
    kind = _BLENDED if description.name.endswith(_description_suffix(_BLENDED)) else _GPT
    return {name: Path(f"{stem}{name}.npy") for name in _INDICES[kind]}


def _load_index(path: Path) -> np.ndarray:
    """An index file memory-mapped as ``np.load(path, mmap_mode="r")`` maps it, but through a
    descriptor opened as a regular file (``open_regular``: numpy's own plain open would wait for
    ever on a FIFO in the cache); a file that is not a plain array is one line naming it."""
    try:
        with open_regular(path) as f:
            version = npy.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"format version {version} is not read here")
            read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
            shape, fortran, dtype = read_header(f)
            if dtype.hasobject:
                raise ValueError("it holds Python objects")
            order = "F" if fortran else "C"
            return np.memmap(f, dtype=dtype, mode="r", shape=shape, order=order, offset=f.tell())
    except CkptopsError as e:
        raise UsageError(str(e)) from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: unreadable dataset index ({e})") from None


class _Indices:
    """One dataset's index files, memory-mapped. Every entry is read with its range checked: the
    files are the job's (or anyone's who can write the cache), and an entry out of range would
    silently read another sample (numpy counts a negative index from the end) or stop in numpy's
    own words. Anything wrong is one line naming the file."""

    def __init__(self, description: Path):
        self.paths = _index_files(description)
        self.arrays = {}
        for name, path in self.paths.items():
            array = _load_index(path)
            shape = (2,) if name == "sample_index" else ()
            if (
                not np.issubdtype(array.dtype, np.integer)
                or array.ndim != 1 + len(shape)
                or array.shape[1:] != shape
            ):
                raise UsageError(
                    f"{path}: not a dataset index ({array.dtype} {list(array.shape)}; expected integers, "
                    f"{'pairs' if shape else 'one per entry'})"
                )
            self.arrays[name] = array

    def __len__(self) -> int:
        return len(self.arrays["shuffle_index" if "shuffle_index" in self.arrays else "dataset_index"])

    def entry(self, name: str, k: int, size: int | None = None):
        """Entry ``k`` of index ``name``, each of its values in ``0 .. size - 1`` when given."""
        array = self.arrays[name]
        if not 0 <= k < len(array):
            raise UsageError(f"{self.paths[name]}: no entry {k} (it has {len(array)})")
        value = array[k]
        if size is not None and not ((value >= 0) & (value < size)).all():
            raise UsageError(
                f"{self.paths[name]}: entry {k} is {value.tolist()}, outside 0..{size - 1}: the index "
                "does not fit the others"
            )
        return value


def _gpt_sample(indices: _Indices, position: int, s: int, dataset: int) -> Sample:
    """Sample ``s`` of a GPTDataset, served at ``position``."""
    document_index = indices.arrays["document_index"]
    (begin, first), (end, last) = indices.entry("sample_index", s), indices.entry("sample_index", s + 1)
    if not (0 <= begin <= end < len(document_index) and first >= 0 and last >= 0):
        raise UsageError(
            f"{indices.paths['sample_index']}: entries {s} and {s + 1} ([{begin}, {first}], "
            f"[{end}, {last}]) do not fit the {len(document_index)} entries of the document index"
        )
    documents = [int(d) for d in document_index[int(begin) : int(end) + 1]]
    return Sample(position, s, dataset, documents, int(first), int(last))


def batch_samples(indices: list[_Indices], consumed: int, count: int) -> list[Sample]:
    """The samples at positions ``consumed .. consumed + count - 1`` of the dataset's order:
    ``indices`` is one GPTDataset's, or a blend's followed by each of its datasets'."""
    order = len(indices[0])
    if consumed < 0 or count < 1:
        raise UsageError(
            f"a batch of {count} samples after {consumed}: no such positions in the dataset "
            "(the checkpoint's consumed samples and global batch size)"
        )
    if consumed + count > order:
        raise UsageError(
            f"the batch after {consumed} samples runs past the dataset's {order} samples: "
            "the run's last batch, or indices built for fewer samples"
        )
    found = []
    for position in range(consumed, consumed + count):
        if len(indices) == 1:
            samples = len(indices[0].arrays["sample_index"]) - 1
            s = int(indices[0].entry("shuffle_index", position, samples))
            found.append(_gpt_sample(indices[0], position, s, 0))
            continue
        dataset = int(indices[0].entry("dataset_index", position, len(indices) - 1))
        member = indices[1 + dataset]
        k = int(indices[0].entry("dataset_sample_index", position, len(member)))
        s = int(member.entry("shuffle_index", k, len(member.arrays["sample_index"]) - 1))
        found.append(_gpt_sample(member, position, s, dataset))
    return found


def next_batch(directory: Path, cache: Path | None = None) -> NextBatch:
    """The global batch the run of checkpoint ``directory`` trains on after it, from its args
    and the dataset's index files in ``cache`` (default: the job's own ``--data-cache-path``)."""
    directory = Path(directory)
    if layout.parse_iter_dir(directory.name) is None or not directory.is_dir():
        raise UsageError(f"{directory}: not a checkpoint directory (expected iter_NNNNNNN)")
    common, args = _saved_args(directory)
    _supported(args, directory)
    cache = Path(cache or getattr(args, "data_cache_path", None) or "")
    if not str(cache) or not cache.is_dir():
        raise UsageError(
            f"{directory}: no data cache to read (the job ran without --data-cache-path, or {cache} "
            "is not a folder here): give --data-cache-path"
        )
    descriptions = find_indices(cache, args, directory)
    consumed, size = int(args.consumed_train_samples), int(args.global_batch_size)
    samples = batch_samples([_Indices(d) for d in descriptions], consumed, size)
    version = _index_digests(descriptions)
    return NextBatch(
        str(directory), int(common["iteration"]), consumed, size, str(descriptions[0]), version, samples
    )


def _saved_args(directory: Path) -> tuple[dict, object]:
    """The checkpoint's common state and the job's args in it, each problem one line naming the
    checkpoint's folder: an empty or unfinished one (no ``.metadata``) says so, exit 2."""
    if not (directory / layout.DCP_METADATA).exists():
        raise UsageError(
            f"{directory}: no {layout.DCP_METADATA}: an empty or unfinished save, or not a torch_dist "
            "checkpoint: its args, and so the data order, cannot be read"
        )
    try:
        index = build_index(load_dcp_metadata(directory / layout.DCP_METADATA))
        common = load_common_state(directory, index)
    except CheckFailed as e:
        raise Malformed(f"{directory}: {e}") from None
    try:
        args = dialect.job_args(directory, common, index)
    except ValueError as e:
        raise Malformed(f"{directory}: its Megatron-Bridge state cannot be read ({e})") from None
    except OSError as e:
        raise unreadable(directory, e) from None
    if args is None:
        raise UsageError(f"{directory}: no args in its common state: the data order cannot be computed")
    return common, args


def _index_digests(descriptions: list[Path], known: dict | None = None) -> dict[str, dict]:
    """SHA-256, size and mtime of the description and index files; a file whose size and mtime
    ``known`` has (an earlier record of the same files) keeps its digest there, unread."""
    found = {}
    for path in [p for d in descriptions for p in [d, *_index_files(d).values()]]:
        try:
            stat = path.stat()
            earlier = (known or {}).get(path.name)
            same = earlier and (earlier["size"], earlier["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns)
            digest = earlier["sha256"] if same else _sha256(path)
        except OSError as e:
            raise UsageError(f"{path}: the dataset index cannot be read ({e.strerror})") from None
        found[path.name] = {"sha256": digest, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return found


def _sha256(path: Path) -> str:
    """A dataset index file's SHA-256, read as a regular file only (``open_regular``: anything
    else put in the cache, a FIFO, would block a plain open); ``UsageError`` naming it when it
    cannot be read."""
    try:
        with open_regular(path) as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except Unreadable as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror or e}") from None


def data_version(args, where: Path, known: dict | None = None) -> dict:
    """What data a checkpoint's run trains on, for its manifest: the dataset or blend and the
    settings that order it (``blend`` is their SHA-256), and the train indices' files in its
    data cache with their SHA-256s (``indices``; a file ``known``, an earlier record, has with
    the same size and mtime is not read again). Where the indices cannot be had, ``note`` says
    why, and ``indices`` is None; where that is only how the cache is now (not here, a file
    unreadable or malformed), not what the job did, the note is ``transient``: the next
    verification of the checkpoint reads the cache again (``settled``)."""
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
        if not cache:
            raise UsageError(f"{where}: no data cache here (the job ran without --data-cache-path)")
    except UsageError as e:
        return version | {"note": str(e)}
    try:
        if not Path(cache).is_dir():
            raise UsageError(f"{where}: no data cache here ({cache})")
        descriptions = find_indices(Path(cache), args, where)
        version["indices"] = _index_digests(descriptions, (known or {}).get("indices"))
    except UsageError as e:
        version |= {"note": str(e), "transient": True}
    return version


def settled(recorded: dict | None) -> bool:
    """Whether a recorded ``data_version`` is final: not one whose indices could not be read
    then (a transient note), which a later verification reads again."""
    return not (isinstance(recorded, dict) and recorded.get("transient"))


def changed_indices(recorded: dict) -> list[str]:
    """The recorded index files (``data_version``'s) whose bytes are not those recorded now:
    each named with what changed; read again whatever their size and mtime say."""
    changed = []
    for name, was in (recorded.get("indices") or {}).items():
        try:
            now = _sha256(Path(recorded["cache"]) / name)
        except UsageError as e:
            changed.append(str(e))
            continue
        if now != was["sha256"]:
            changed.append(f"{name}: sha256 {now[:12]}, recorded {was['sha256'][:12]}")
    return changed
