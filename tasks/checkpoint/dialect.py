"""Which training framework wrote a checkpoint, and its run's settings in one vocabulary.

Two dialects around the same torch_dist shards, recognised by what is on disk, never by a profile:

- **Megatron-LM** (``pretrain_gpt.py``): its args, a pickled ``argparse.Namespace`` with the run's
  progress counters, in the common state.
- **Megatron-Bridge** (NeMo's recipes, 0.4-0.6): no args in the common state; beside the shards
  ``train_state.pt`` (step, consumed and skipped samples, as int64 tensors; int32 before 0.4),
  ``run_config.yaml`` (the whole ``ConfigContainer``), ``tokenizer/``; at the top of the save
  directory ``latest_train_state.pt`` (the copy its resume reads) and Megatron-LM's tracker; the
  data loader's per-rank state under ``<save>/energon/iter_N/`` (0.6) or the iteration's own
  ``dataloader_state/`` (its docs), one ``train_dataloader_dprankNNN.pt`` per data-parallel rank.

``job_args`` gives both as Megatron-LM's names, so no consumer asks which dialect it reads; the
Bridge's own completeness rules (``findings``) are the checks its silent-resume bugs call for.
"""

import io
import re
import time
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.checks import VerifyCheck
from tasks.storage.bounded import load_yaml, read_bounded

MEGATRON_LM = "megatron-lm"
BRIDGE = "megatron-bridge"

TRAIN_STATE = "train_state.pt"
RUN_CONFIG = "run_config.yaml"
TOKENIZER = "tokenizer"
LATEST_TRAIN_STATE = "latest_train_state.pt"
DATALOADER_SUBDIR = "energon"  # Bridge 0.6: <save>/energon/iter_N/
DATALOADER_IN_ITER = "dataloader_state"  # Bridge's docs: iter_N/dataloader_state/
_DATALOADER_FILE = re.compile(r"^train_dataloader_dprank(\d{3,})\.pt$", re.ASCII)
_INT32 = 1 << 32
_REWRITTEN_SECONDS = 60  # how long a resume file that does not read may be one being copied
_SMALL = 64 << 20  # a data loader state: some MB
_TRAIN_STATE_LIMIT = 1 << 20  # a few KB: a handful of counters
_RUN_CONFIG_LIMIT = 4 << 20  # tens of KB; the YAML parser takes seconds a MB
# Tokenizers whose files Bridge copies into tokenizer/ (its save_tokenizer_assets); a
# NullTokenizer leaves the folder empty.
_NO_TOKENIZER_FILES = {"NullTokenizer", None}


@dataclass(frozen=True)
class Finding:
    check: VerifyCheck
    file: str | None
    detail: str


def dialect_of(directory: Path) -> str:
    """Bridge as far as a listing can tell: where Bridge's progress file ``train_state.pt``, the
    first of its own files it writes after the shards, is in the iteration directory, or where its
    resume file lies beside it (the save may not have written its own yet). A ``run_config.yaml``
    alone is not Bridge's (it writes that after ``train_state.pt``). What the checkpoint holds
    decides the rest: Megatron-LM's args in its common state make it Megatron-LM's, whatever lies
    beside them (``job_args``, ``findings``)."""
    directory = Path(directory)
    if (directory / TRAIN_STATE).exists():
        return BRIDGE
    return BRIDGE if (directory.parent / LATEST_TRAIN_STATE).exists() else MEGATRON_LM


def _read(path: Path, limit: int = _SMALL, what: str = "a Megatron-Bridge file") -> bytes:
    """A small file of the save directory, the one at that name (no link, FIFO or device
    followed), at most ``limit`` bytes (``bounded.read_bounded``)."""
    return read_bounded(path, limit, what, follow=False)


def load_small(path: Path, limit: int = _SMALL):
    """A small torch.save file of tensors and plain types (train_state.pt, a plain data loader
    state), read with the safe loader: nothing in it is unpickled beyond those."""
    from tasks.checkpoint.dcp import weights_only_load

    return weights_only_load(io.BytesIO(_read(path, limit)), Path(path).name)


def train_state(path: Path) -> dict[str, float | int | bool]:
    """``train_state.pt`` (or ``latest_train_state.pt``) as plain numbers; ValueError naming
    what is wrong when it holds anything else."""
    loaded = load_small(path, _TRAIN_STATE_LIMIT)
    if not isinstance(loaded, dict) or "step" not in loaded:
        raise ValueError(f"{Path(path).name} holds no training state (a {type(loaded).__name__})")
    try:
        return {k: v.item() if hasattr(v, "item") else v for k, v in loaded.items()}
    except (RuntimeError, ValueError) as e:  # a tensor of more than one number
        raise ValueError(f"{Path(path).name}: {e}") from None


def run_config(path: Path) -> dict:
    """``run_config.yaml``: at most 4 MiB, nested at most ``bounded.MAX_DEPTH`` deep, a mapping;
    Malformed naming the file and the limit otherwise."""
    loaded = load_yaml(_read(path, _RUN_CONFIG_LIMIT, "the run config"), path, "the run config")
    if not isinstance(loaded, dict):
        raise ValueError(f"{Path(path).name} is a {type(loaded).__name__}, not a mapping")
    return loaded


# Megatron-LM's arg name: (run_config section, its key).
_FROM_CONFIG = {
    "global_batch_size": ("train", "global_batch_size"),
    "micro_batch_size": ("train", "micro_batch_size"),
    "rampup_batch_size": ("train", "rampup_batch_size"),
    "train_iters": ("train", "train_iters"),
    "train_samples": ("train", "train_samples"),
    "tensor_model_parallel_size": ("model", "tensor_model_parallel_size"),
    "pipeline_model_parallel_size": ("model", "pipeline_model_parallel_size"),
    "context_parallel_size": ("model", "context_parallel_size"),
    "expert_model_parallel_size": ("model", "expert_model_parallel_size"),
    "num_layers": ("model", "num_layers"),
    "hidden_size": ("model", "hidden_size"),
    "ffn_hidden_size": ("model", "ffn_hidden_size"),
    "num_attention_heads": ("model", "num_attention_heads"),
    "num_query_groups": ("model", "num_query_groups"),
    "kv_channels": ("model", "kv_channels"),
    "seq_length": ("model", "seq_length"),
    "vocab_size": ("model", "vocab_size"),
    "make_vocab_size_divisible_by": ("model", "make_vocab_size_divisible_by"),
    "normalization": ("model", "normalization"),
    "position_embedding_type": ("model", "position_embedding_type"),
    "num_experts": ("model", "num_moe_experts"),
    "bf16": ("model", "bf16"),
    "fp16": ("model", "fp16"),
    "lr": ("optimizer", "lr"),
    "min_lr": ("optimizer", "min_lr"),
    "weight_decay": ("optimizer", "weight_decay"),
    "clip_grad": ("optimizer", "clip_grad"),
    "optimizer": ("optimizer", "optimizer"),
    "use_distributed_optimizer": ("optimizer", "use_distributed_optimizer"),
    "lr_warmup_init": ("scheduler", "lr_warmup_init"),
    "lr_decay_style": ("scheduler", "lr_decay_style"),
    "lr_wsd_decay_style": ("scheduler", "lr_wsd_decay_style"),
    "lr_wsd_decay_iters": ("scheduler", "lr_wsd_decay_iters"),
    "lr_wsd_decay_samples": ("scheduler", "lr_wsd_decay_samples"),
    "save_interval": ("checkpoint", "save_interval"),
    "save": ("checkpoint", "save"),
    "load": ("checkpoint", "load"),
    "ckpt_step": ("checkpoint", "ckpt_step"),
    "exit_on_missing_checkpoint": ("checkpoint", "exit_on_missing_checkpoint"),
    "seed": ("rng", "seed"),
}


_TO_MEGATRON = {where: name for name, where in _FROM_CONFIG.items()}


def megatron_name(section: str, key: str) -> str | None:
    """Megatron-LM's argument name for a ``run_config.yaml`` field (None where it has none)."""
    return _TO_MEGATRON.get((section, key))


def bridge_args(directory: Path, index=None) -> Namespace:
    """A Bridge checkpoint's run settings and progress in Megatron-LM's arg names, from its
    ``train_state.pt`` and ``run_config.yaml``. The data-parallel size, which Bridge does not
    record, is the writing ranks over TP x PP x CP when every rank wrote (its default
    fully-parallel save), else unknown."""
    directory = Path(directory)
    state = train_state(directory / TRAIN_STATE)
    config = run_config(directory / RUN_CONFIG)
    found = {name: (config.get(section) or {}).get(key) for name, (section, key) in _FROM_CONFIG.items()}
    model, checkpoint = config.get("model") or {}, config.get("checkpoint") or {}
    found.update(
        iteration=int(state["step"]),
        consumed_train_samples=int(state["consumed_train_samples"]),
        skipped_train_samples=int(state.get("skipped_train_samples", 0)),
        floating_point_operations=float(state.get("floating_point_operations_so_far", 0.0)),
        untie_embeddings_and_output_weights=not model.get("share_embeddings_and_output_weights", True),
        swiglu=bool(model.get("gated_linear_unit")),
        add_bias_linear=model.get("add_bias_linear", True),
        no_save_optim=checkpoint.get("save_optim") is False,
        no_save_rng=checkpoint.get("save_rng") is False,
        ckpt_format=checkpoint.get("ckpt_format", "torch_dist"),
        data_parallel_size=_data_parallel(found, checkpoint, index),
        written_by=BRIDGE,
    )
    return Namespace(**found)


def _data_parallel(found: dict, checkpoint: dict, index) -> int | None:
    if index is None or checkpoint.get("fully_parallel_save") is False:
        return None
    ranks = layout.writing_ranks(index.files)
    model = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model *= int(found.get(name) or 1)
    world = max(ranks, default=-1) + 1
    return world // model if world and world % model == 0 else None


def job_args(directory: Path, common: dict, index=None):
    """The run's settings in Megatron-LM's names, whichever framework wrote the checkpoint;
    None when it holds neither dialect's. Bridge files that cannot be read raise ValueError or
    OSError naming nothing: callers name the file (``findings`` does)."""
    if common.get("args") is not None:
        return common["args"]
    if (Path(directory) / TRAIN_STATE).exists():
        return bridge_args(directory, index)
    return None


def expected_consumed(args, iterations: int) -> tuple[int, int] | None:
    """The fewest and most samples ``iterations`` steps consume: the global batch size each, the
    same two numbers. With a ramp-up (``rampup_batch_size``: start, increment, samples) each step
    takes from the start size to the global one: Megatron-Core up to 0.18 ramps, 0.19 ignores the
    setting (and Bridge 0.6 passes it to that, and no step schedule), so only the bounds hold."""
    gbs = getattr(args, "global_batch_size", None)
    if not gbs:
        return None
    rampup = getattr(args, "rampup_batch_size", None)
    smallest = min(int(rampup[0]), int(gbs)) if rampup else int(gbs)
    return iterations * max(1, smallest), iterations * int(gbs)


def dataloader_dir(directory: Path) -> Path | None:
    """Where the iteration's per-rank data loader state is, if anywhere."""
    directory = Path(directory)
    for candidate in (directory / DATALOADER_IN_ITER, directory.parent / DATALOADER_SUBDIR / directory.name):
        if candidate.is_dir():
            return candidate
    return None


def _dataloader_files(where: Path | None) -> dict[int, Path]:
    """The data loader state files in ``where`` (``dataloader_dir``), by data-parallel rank."""
    found = {}
    if where is not None:
        for path in where.iterdir():
            match = _DATALOADER_FILE.match(path.name)
            if match and path.is_file() and not path.is_symlink():
                found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def findings(
    directory: Path, iteration: int, args, data_parallel: int | None, previous: tuple[int, int] | None = None
) -> list[Finding]:
    """A checkpoint's own dialect's completeness rules; none beyond the shared ones for
    Megatron-LM's (args in its common state decide that, whatever lies beside it). Without args
    (``job_args`` found none, or Bridge's files could not be read), Bridge's rules where a file
    of Bridge's is there to say why. ``data_parallel``: the job's size where the profile knows
    it; ``previous``: the iteration and consumed samples of the job's newest verified checkpoint
    before this one."""
    directory = Path(directory)
    if args is not None and getattr(args, "written_by", MEGATRON_LM) != BRIDGE:
        return []
    if args is None and dialect_of(directory) != BRIDGE and not (directory / RUN_CONFIG).exists():
        return []
    found = _bridge_files(directory)
    if found or args is None:
        return found
    found += _bridge_counters(directory, iteration, args, previous)
    return found + _bridge_dataloader(directory, args, data_parallel or args.data_parallel_size)


def keeps_tokenizer(config: dict) -> bool:
    """Whether Bridge writes tokenizer files into the checkpoint, by its run_config.yaml."""
    saves = (config.get("checkpoint") or {}).get("save_tokenizer_assets", True) is not False
    return saves and (config.get("tokenizer") or {}).get("tokenizer_type") not in _NO_TOKENIZER_FILES


def _bridge_files(directory: Path) -> list[Finding]:
    missing = []
    for name in (TRAIN_STATE, RUN_CONFIG):
        if not (directory / name).is_file():
            missing.append(Finding(VerifyCheck.COMPLETE, name, f"missing{_pr5746(directory, name)}"))
    config = {}
    for name in (TRAIN_STATE, RUN_CONFIG):
        if (directory / name).is_file():
            try:
                read = (train_state if name == TRAIN_STATE else run_config)(directory / name)
            except Exception as e:  # noqa: BLE001 (whatever the file holds, it is not readable)
                missing.append(Finding(VerifyCheck.STATE, name, f"unreadable ({type(e).__name__}: {e})"))
                continue
            config = read if name == RUN_CONFIG else config
    if config and keeps_tokenizer(config) and not tokenizer_files(directory):
        missing.append(Finding(VerifyCheck.COMPLETE, f"{TOKENIZER}/", "missing or empty"))
    return missing


def tokenizer_files(directory: Path) -> dict:
    """The regular files of the checkpoint's ``tokenizer/`` as ``tokenizer/<name>``, with their
    stats (a symlinked folder or file is not the checkpoint's)."""
    from tasks.storage.local import list_files

    folder = Path(directory) / TOKENIZER
    if folder.is_symlink() or not folder.is_dir():
        return {}
    return {f"{TOKENIZER}/{name}": st for name, st in list_files(folder).items()}


def checkpoint_files(directory: Path, listed: dict) -> dict:
    """A checkpoint's files for its manifest: the directory's own (``listed``), and where
    Megatron-Bridge wrote it, its tokenizer's."""
    return listed | tokenizer_files(directory) if dialect_of(directory) == BRIDGE else listed


def _pr5746(directory: Path, name: str) -> str:
    """What a missing file means when Bridge's resume pointer already names the iteration."""
    if name != RUN_CONFIG or _latest_step(directory.parent) != layout.parse_iter_dir(directory.name):
        return ""
    return (
        f", yet {LATEST_TRAIN_STATE} already names this iteration: the resume pointer was published "
        "before the run's config (Megatron-Bridge PR#5746)"
    )


def _latest_step(save_dir: Path) -> int | None:
    try:
        return int(train_state(Path(save_dir) / LATEST_TRAIN_STATE)["step"])
    except Exception:  # noqa: BLE001 (absent or unreadable: it names nothing)
        return None


def _bridge_counters(
    directory: Path, iteration: int, args, previous: tuple[int, int] | None
) -> list[Finding]:
    found = []
    if args.iteration != iteration:
        found.append(
            Finding(
                VerifyCheck.ITERATION,
                TRAIN_STATE,
                f"says step {args.iteration}, the directory {iteration}: a resume from it would "
                "start elsewhere (Megatron-Bridge #4900, #5090, #5260, #3503)",
            )
        )
    consumed, skipped = args.consumed_train_samples, args.skipped_train_samples
    wrapped = f"consumed_train_samples {consumed}: a wrapped 32-bit counter (Megatron-Bridge PR#3312)"
    if consumed < 0:
        return [*found, Finding(VerifyCheck.STATE, TRAIN_STATE, wrapped)]
    # The sum so far counts from the job's newest verified checkpoint: a run may change its global
    # batch size at a resume, and run_config.yaml holds only the current one.
    bounds = (
        expected_consumed(args, iteration - previous[0]) if previous and previous[0] < iteration else None
    )
    if bounds is None:
        return found
    low, high = previous[1] + bounds[0], previous[1] + bounds[1]
    make = (
        f"{previous[1]} samples at iteration {previous[0]} and {iteration - previous[0]} iterations of the "
        f"run's global batch size make " + (f"{high}" if low == high else f"{low} to {high}")
    )
    if consumed != high and consumed % _INT32 == high % _INT32:
        found.append(Finding(VerifyCheck.STATE, TRAIN_STATE, f"{wrapped}; {make}"))
    elif not low - skipped <= consumed <= high:
        found.append(
            Finding(VerifyCheck.STATE, TRAIN_STATE, f"consumed_train_samples {consumed}, but {make}")
        )
    return found


def _bridge_dataloader(directory: Path, args, data_parallel: int | None) -> list[Finding]:
    where = dataloader_dir(directory)
    if where is None or data_parallel is None:
        return []
    files = _dataloader_files(where)
    name = f"{where.relative_to(directory.parent)}/"
    missing = [r for r in range(data_parallel) if r not in files]
    extra = [r for r in files if r >= data_parallel]
    if missing or extra:
        ranks = ", ".join(f"dprank{r:03d}" for r in (missing or extra))
        return [
            Finding(
                VerifyCheck.COMPLETE,
                name,
                f"{len(files)} data loader state files for data-parallel size {data_parallel} "
                f"({'missing' if missing else 'extra'}: {ranks}): a resume would silently drop "
                "the ranks' data positions (Megatron-Bridge PR#5637)",
            )
        ]
    consumed = args.consumed_train_samples
    return [
        Finding(
            VerifyCheck.STATE,
            f"{name}{files[rank].name}",
            f"data position {position} samples, {TRAIN_STATE} {consumed}: the rank would resume "
            "elsewhere in its data than the run",
        )
        for rank, position in _positions(files).items()
        if position is not None and position != consumed
    ]


def data_positions(directory: Path) -> dict[int, int | None]:
    """Each data-parallel rank's saved data position (samples consumed) for the iteration, where
    its state is a plain one the safe loader reads; None for a state of Energon's own classes,
    which are never unpickled here."""
    return _positions(_dataloader_files(dataloader_dir(directory)))


def _positions(files: dict[int, Path]) -> dict[int, int | None]:
    found = {}
    for rank, path in files.items():
        try:
            state = load_small(path).get("dataloader_state_dict")
        except Exception:  # noqa: BLE001 (Energon's own classes: refused by the safe loader)
            state = None
        consumed = state.get("consumed_samples") if isinstance(state, dict) else None
        found[rank] = int(consumed) if isinstance(consumed, int) else None
    return found


def pointer_alarm(save_dir: Path) -> str | None:
    """Bridge's resume file naming an iteration that is not complete: the next resume loads it.
    None when there is no such file or it names a complete iteration."""
    save_dir = Path(save_dir)
    if not (save_dir / LATEST_TRAIN_STATE).exists():
        return None
    step = _latest_step(save_dir)
    if step is None and time.time() - (save_dir / LATEST_TRAIN_STATE).stat().st_mtime < _REWRITTEN_SECONDS:
        return None  # Bridge rewrites it in place (shutil.copy): read mid-copy, not broken
    if step is None:
        return f"{save_dir / LATEST_TRAIN_STATE}: unreadable: Megatron-Bridge's resume has no start"
    directory = save_dir / layout.iter_dir_name(step)
    if not directory.is_dir():
        return f"{save_dir / LATEST_TRAIN_STATE}: names iteration {step}, which has no directory"
    lacking = [f.file for f in _bridge_files(directory) if f.check is VerifyCheck.COMPLETE]
    if not (directory / layout.METADATA_JSON).is_file():
        lacking.insert(0, layout.METADATA_JSON)
    if not lacking:
        return None
    return (
        f"{save_dir / LATEST_TRAIN_STATE}: names iteration {step}, which is not complete "
        f"({', '.join(lacking)} missing): Megatron-Bridge's resume would load it"
        + (" (PR#5746)" if RUN_CONFIG in lacking else "")
    )
