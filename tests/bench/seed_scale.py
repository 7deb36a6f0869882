"""Synthetic Megatron-Core torch_dist checkpoints at the scale of a 500B job, for the benches.

A 500B job (TP 8, PP 8, DP 80: 5,120 ranks, distributed optimizer) saves one data file per rank
and a ``.metadata`` indexing a million or more records. This module makes such a checkpoint on one
machine: one ``__<rank>_0.distcp`` per simulated rank and about ``records`` records in all, with
small tensors (at TP 8, PP 8, DP 80 about 470 MB for 100,000 records, 4.5 GB for a million).

The files are written by the real save code, rank by rank. Each simulated rank's state dict is
built with megatron-core's own helpers, with the keys, offsets and replica ids megatron gives:
- the model (the local job's layer spec): decoder layers stacked on a prepended layer axis,
  tensors sharded over TP or replicated over it, the layers' extra states as objects, the
  embeddings on the first stage, the final norm on the last; replicated over DP and saved by DP
  rank 0, or with ``fully_parallel`` spread over the DP group by megatron's own distribution, as
  Megatron-LM's default ``--ckpt-fully-parallel-save`` spreads them;
- the distributed optimizer's state in the layout megatron-core 0.19.2 saves by default,
  ``dp_reshardable`` (no ``--dist-ckpt-optim-fully-reshardable``): per model-parallel rank a
  ``dp_group_idx_<n>`` set of bucket tensors (fp32 main params, ``exp_avg``, ``exp_avg_sq``), each
  DP rank saving its slice of every bucket cut at parameter boundaries, the buckets laid out by
  megatron's own padding functions; each group's param groups and bucket sizes as objects;
- every rank's rerun-state object, each model-parallel rank's RNG state, rank 0's common state.
Each state dict goes through ``save_preprocess`` and TorchDistSaveShardedStrategy's conversion
(``_replace_state_dict_keys_with_sharded_keys``, ``mcore_to_pyt_state_dict``), is planned by
``MCoreSavePlanner`` and written by torch's ``FileSystemWriter``. Planning takes megatron's
decentralized path (``save_state_dict_async_plan``): a rank's global plan is its local plan with
its ``__<rank>_`` prefix, checked to be what torch's coordinator path
(``FileSystemWriter.prepare_global_plan``) gives; the coordinator makes the global metadata with
``create_global_plan`` over all the local plans, keeps them in it as ``all_local_plans`` as megatron
does, and writes ``.metadata`` with ``finish``, as megatron's ``FileSystemWriterAsync`` (torch's
``finish``, with the checkpoint id a str where torch's own writer would pickle a PosixPath).
Torch's ``fake`` process group answers the rank and world-size questions of the conversion;
nothing is communicated. DP groups are saved by a pool of processes, one per core.

What is not a 500B job's: the model is tiny, hidden size 64 and one attention head per tensor
rank, its matrices the smallest a bucket can hold (megatron needs every DP rank to hold part of
every bucket). The records are set by the layers per stage (the last stage's on their own, as
Megatron-LM's ``--decoder-last-pipeline-num-layers``) and by ``--ddp-bucket-size``: each bucket is
saved in about DP pieces of three records, which is where most of a real job's records come from.

The common state (args, scheduler, rerun state), the RNG state, the optimizer's param groups and
``metadata.json`` are taken from a real Megatron-LM checkpoint (the local training job's, trained
once into data/bench), with the args describing the layout and the model set to the seed's; the
iteration is 100 and Megatron's tracker file names it. Tensor values are small, finite and
deterministic from ``seed``: a bf16 weight and its fp32 main param agree, ``exp_avg_sq`` is never
negative.

Generation is cached: ``.generated.json`` beside the checkpoint, written last, records the
parameters and what was made; a folder holding it with the same parameters is returned as it is.

    python -m tests.bench.seed_scale DIR --tp 8 --pp 8 --dp 80 --records 100000
"""

import argparse
import copy
import dataclasses
import functools
import gc
import io
import json
import logging
import math
import os
import shutil
import sys
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ITERATION = 100
HIDDEN = 64
MARKER = ".generated.json"
PARAM_DTYPE, GRAD_DTYPE = torch.bfloat16, torch.float32  # bf16 training, fp32 grads and main params
# Module parameters of one layer in model.parameters() order (the local job's layer spec), as
# (name, local shape, TP axis or None when replicated over TP); one attention head of kv_channels
# per tensor rank, "qkv" its 3 x kv_channels rows.
_LAYER = (
    ("self_attention.linear_qkv.layer_norm_weight", ("h",), None),
    ("self_attention.linear_qkv.layer_norm_bias", ("h",), None),
    ("self_attention.linear_proj.weight", ("h", "kv"), 1),
    ("self_attention.linear_proj.bias", ("h",), None),
    ("self_attention.linear_qkv.weight", ("qkv", "h"), 0),
    ("self_attention.linear_qkv.bias", ("qkv",), 0),
    ("mlp.linear_fc1.layer_norm_weight", ("h",), None),
    ("mlp.linear_fc1.layer_norm_bias", ("h",), None),
    ("mlp.linear_fc1.weight", ("ffn", "h"), 0),
    ("mlp.linear_fc1.bias", ("ffn",), 0),
    ("mlp.linear_fc2.weight", ("h", "ffn"), 1),
    ("mlp.linear_fc2.bias", ("h",), None),
)
_EXTRA_STATES = (
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


@dataclass(frozen=True)
class Job:
    """The simulated job: its parallel layout and the model and buckets that set the records."""

    tp: int
    pp: int
    dp: int
    layers: int  # per pipeline stage but the last
    last_layers: int  # on the last stage (Megatron-LM's --decoder-last-pipeline-num-layers)
    bucket: int  # --ddp-bucket-size, in elements
    kv: int  # per tensor rank: kv_channels (one attention head)
    ffn: int  # per tensor rank: ffn_hidden_size
    vocab: int  # per tensor rank: rows of the word embeddings
    positions: int  # max_position_embeddings
    seed: int = 0
    fully_parallel: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_layers(self) -> int:
        return self.layers * (self.pp - 1) + self.last_layers

    def stage_layers(self, pp_rank: int) -> int:
        return self.last_layers if pp_rank == self.pp - 1 else self.layers

    def rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Megatron's default rank order, tp-cp-ep-dp-pp (CP and EP 1)."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)


@dataclass(frozen=True)
class Param:
    """One module parameter of a pipeline stage, on one tensor rank (shapes are local)."""

    key: str  # the ShardedTensor key (decoder layers share one key, stacked on the layer axis)
    shape: tuple[int, ...]
    tp_axis: int | None  # None: replicated over TP (saved from tensor rank 0)
    layer: int | None = None  # the global layer index, prepended as axis 0
    saved: bool = True  # False: the tied output layer, in the optimizer's buffer only
    shared_embedding: bool = False  # megatron puts it in a bucket of its own

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@functools.cache
def stage_params(job: Job, pp_rank: int) -> tuple[Param, ...]:
    """A stage's parameters in model.parameters() order: the embeddings on the first stage, its
    layers, the final layer norm on the last, and there (PP > 1) the tied output layer's copy."""
    first, last = pp_rank == 0, pp_rank == job.pp - 1
    units = {"h": HIDDEN, "kv": job.kv, "qkv": 3 * job.kv, "ffn": job.ffn}
    params = []
    if first:
        params.append(
            Param("embedding.word_embeddings.weight", (job.vocab, HIDDEN), 0, None, True, job.pp > 1)
        )
        params.append(Param("embedding.position_embeddings.weight", (job.positions, HIDDEN), None))
    for i in range(job.stage_layers(pp_rank)):
        layer = pp_rank * job.layers + i
        for name, shape, axis in _LAYER:
            params.append(Param(f"decoder.layers.{name}", tuple(units[u] for u in shape), axis, layer))
    if last:
        params.append(Param("decoder.final_layernorm.weight", (HIDDEN,), None))
        params.append(Param("decoder.final_layernorm.bias", (HIDDEN,), None))
        if job.pp > 1:
            params.append(Param("output_layer.weight", (job.vocab, HIDDEN), 0, None, False, True))
    return tuple(params)


@dataclass(frozen=True)
class Bucket:
    unpadded: int
    padded: int
    params: tuple[tuple[Param, int, int], ...]  # (param, start, end) within the bucket


def buckets(job: Job, params: tuple[Param, ...]) -> list[Bucket]:
    """The grad buffer's buckets as megatron-core lays them out
    (``DistributedOptimizer._compute_per_buffer_param_layout``): parameters in reverse order,
    each starting on a 64-element boundary, a bucket closed once it reaches the bucket size or
    around a shared embedding, its end padded for DP divisibility."""
    from megatron.core.optimizer.param_layout import pad_bucket_end, pad_param_start

    found, members = [], []
    start = bucket_start = end = 0

    def close(at: int) -> int:
        padded = pad_bucket_end(at, job.dp, False)
        spans = tuple((p, s - bucket_start, e - bucket_start) for p, s, e in members)
        found.append(Bucket(at - bucket_start, padded - bucket_start, spans))
        members.clear()
        return padded

    for param in reversed(params):
        start = pad_param_start(start)
        if param.shared_embedding and members:
            bucket_start = start = close(start)
        end = start + param.numel
        members.append((param, start, end))
        if end - bucket_start >= job.bucket or param.shared_embedding:
            bucket_start = start = close(end)
        else:
            start = end
    if members:
        close(end)
    return found


def slice_of(bucket: Bucket, dp_rank: int, dp: int) -> list[tuple[Param, int, int, int]]:
    """A DP rank's contiguous slice of a bucket cut at parameter boundaries, as
    (param, start, end within the flattened param, offset in the bucket tensor)."""
    size = bucket.padded // dp
    low, high = dp_rank * size, (dp_rank + 1) * size
    pieces = []
    for param, s, e in bucket.params:
        a, b = max(s, low), min(e, high)
        if a < b:
            pieces.append((param, a - s, b - s, a))
    return pieces


def feasible(job: Job, layouts: list[list[Bucket]]) -> bool:
    """Megatron asserts that every DP rank holds part of every bucket ('empty bucket
    encountered'); parameters lie with no gap between them only when their sizes are multiples
    of 64 (no intra-param padding is generated here)."""
    for layout in layouts:
        for bucket in layout:
            if (job.dp - 1) * (bucket.padded // job.dp) >= bucket.unpadded:
                return False
            if any(p.numel % 64 for p, _, _ in bucket.params):
                return False
    return True


def count_pieces(bucket: Bucket, dp: int) -> int:
    """How many (param, DP rank) pieces a bucket is saved in: ``slice_of`` over every rank."""
    size = bucket.padded // dp
    return sum((e - 1) // size - s // size + 1 for _, s, e in bucket.params)


def count_records(job: Job, layouts: list[list[Bucket]]) -> int:
    """The records the job's checkpoint will hold (``len(metadata.storage_data)``)."""
    total = 1 + job.world + job.tp * job.pp  # common state, rerun state per rank, RNG state
    for pp_rank, layout in enumerate(layouts):
        params = [p for p in stage_params(job, pp_rank) if p.saved]
        sharded = sum(1 for p in params if p.tp_axis is not None)
        total += sharded * job.tp + (len(params) - sharded) + len(_EXTRA_STATES) * job.stage_layers(pp_rank)
        pieces = sum(count_pieces(b, job.dp) for b in layout)
        total += job.tp * (3 * pieces + 3)  # param, exp_avg, exp_avg_sq; 3 objects per group
    return total


def stage_layouts(job: Job) -> list[list[Bucket]]:
    """The buckets of every stage (the middle stages' are alike: computed once)."""
    kinds: dict[tuple[bool, bool], list[Bucket]] = {}
    found = []
    for pp_rank in range(job.pp):
        kind = (pp_rank == 0, pp_rank == job.pp - 1)
        if kind not in kinds:
            kinds[kind] = buckets(job, stage_params(job, pp_rank))
        found.append(kinds[kind])
    return found


def _records(job: Job) -> int:
    """The job's records, or 0 when megatron could not have saved its layout."""
    layouts = stage_layouts(job)
    return count_records(job, layouts) if feasible(job, layouts) else 0


def _closest(base: Job, records: int) -> Job:
    """The bucket size, from ``base.bucket`` (the smallest) up, whose records come closest to
    ``records``: a larger bucket size merges buckets, giving fewer records."""
    largest = max(sum(p.numel for p in stage_params(base, i)) for i in {0, base.pp - 1})
    fine = {base.bucket + 64 * i for i in range(0, 200)}
    coarse = {int(base.bucket * (largest / base.bucket) ** (i / 50)) for i in range(51)}
    jobs = [dataclasses.replace(base, bucket=bucket) for bucket in sorted(fine | coarse)]
    found = [(abs(n - records), job) for job in jobs if (n := _records(job))]
    return min(found, key=lambda f: f[0])[1]


def size_job(tp: int, pp: int, dp: int, records: int, seed: int = 0, fully_parallel: bool = False) -> Job:
    """The job with about ``records`` records: the fewest layers per stage that reach it at the
    smallest bucket size, the last stage's layers and then the bucket size that come closest.

    Tensors are as small as megatron allows. Each bucket must give every DP rank a part, so a
    bucket spans about DP x lcm(DP, 128) elements or more; at the smallest bucket size each layer
    fills three buckets, closed by linear_fc2, linear_fc1 and the attention's parameters with the
    input layer norm last (linear_qkv and linear_proj sized so), which leaves no small bucket at a
    stage's end. Every parameter's size is a multiple of 64 (no intra-param padding)."""
    rows = dp * math.lcm(dp, 128) // HIDDEN + 1  # of a 64-wide matrix spanning a bucket
    ffn, vocab = -(-rows // 64) * 64, -(-rows // 128) * 128
    kv = max(64, (HIDDEN * ffn - 4 * HIDDEN) // (4 * HIDDEN + 3) // 64 * 64)
    attention = 4 * HIDDEN * kv + 3 * kv + 5 * HIDDEN  # linear_qkv, linear_proj and the two norms
    base = Job(tp, pp, dp, 1, 1, attention, kv, ffn, vocab, max(32, ffn), seed, fully_parallel)

    def most(layers: int) -> int:
        return _records(dataclasses.replace(base, layers=layers, last_layers=layers))

    low, high = 1, 1
    while most(high) < records:
        low, high = high + 1, high * 2
        if high > 4096:
            raise ValueError(f"no layout of TP {tp}, PP {pp}, DP {dp} reaches {records} records")
    while low < high:  # the fewest layers reaching the target
        middle = (low + high) // 2
        low, high = (low, middle) if most(middle) >= records else (middle + 1, high)
    lasts = [dataclasses.replace(base, layers=high, last_layers=n) for n in range(1, high + 1)]
    if pp == 1:
        lasts = lasts[-1:]
    best = min(lasts, key=lambda job: abs(_records(job) - records) if _records(job) else math.inf)
    return _closest(best, records)


# Tensor values ---------------------------------------------------------------------------------


def _values(job: Job, param: Param, tp_rank: int, start: int, end: int, what: str = "param") -> np.ndarray:
    """Elements ``[start, end)`` of a flattened parameter (or of its Adam moments), in fp32:
    a cheap hash of the element's index, so that any slice is made without the rest and a
    weight and its main param (the optimizer's fp32 copy) agree."""
    rank = tp_rank if param.tp_axis is not None else 0  # replicated over TP: the same everywhere
    seed = zlib.crc32(f"{job.seed}/{param.key}/{param.layer}/{rank}/{what}".encode())
    index = np.arange(start, end, dtype=np.uint32)
    uniform = (index * np.uint32(2654435761) + np.uint32(seed)).astype(np.float64) / 2**32
    if what == "exp_avg":
        return ((uniform - 0.5) * 2e-3).astype(np.float32)
    if what == "exp_avg_sq":
        return (uniform * uniform * 1e-6).astype(np.float32)
    if param.key.endswith(("layer_norm_weight", "layernorm.weight")):
        return (1.0 + (uniform - 0.5) * 0.1).astype(np.float32)
    return ((uniform - 0.5) * 0.04).astype(np.float32)


# What comes from the real checkpoint -----------------------------------------------------------


@dataclass
class Source:
    """From a real Megatron-LM checkpoint (the local training job's, distributed optimizer)."""

    common: dict  # the common state: args, iteration, scheduler, rerun state, content metadata
    rng: object  # rng_state's data (a list of one dict)
    rerun: object  # rerun_state_machine_state's data
    param_groups: object  # a data-parallel group's optimizer object (param groups, step)
    metadata_json: bytes


def read_source(directory: Path) -> Source:
    """The objects of a real checkpoint, loaded with megatron-core's safe-globals allowlist."""
    from megatron.core import safe_globals
    from torch.distributed.checkpoint import FileSystemReader

    safe_globals.register_safe_globals()
    metadata = FileSystemReader(str(directory)).read_metadata()
    by_key = {index.fqn: info for index, info in metadata.storage_data.items() if index.offset is None}

    def load(prefix: str):
        key = next(k for k in sorted(by_key) if k.startswith(prefix))
        info = by_key[key]
        with open(directory / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        (value,) = torch.load(io.BytesIO(data), weights_only=True)  # megatron saves [data]
        return value

    return Source(
        common=load("common_state/"),
        rng=load("rng_state/"),
        rerun=load("rerun_state_machine_state/"),
        param_groups=load("optimizer.distributed.dp_group_idx_0.optimizer/"),
        metadata_json=(directory / "metadata.json").read_bytes(),
    )


def common_state(job: Job, source: Source, save_dir: Path) -> dict:
    """The real checkpoint's common state with the seed's layout, model and iteration."""
    common = copy.deepcopy(source.common)
    args = common["args"]
    samples = ITERATION * args.micro_batch_size * job.dp
    layout = dict(
        tensor_model_parallel_size=job.tp,
        pipeline_model_parallel_size=job.pp,
        transformer_pipeline_model_parallel_size=job.pp,
        data_parallel_size=job.dp,
        world_size=job.world,
        use_distributed_optimizer=True,
        dist_ckpt_optim_fully_reshardable=False,
        ckpt_fully_parallel_save=job.fully_parallel,
        num_layers=job.num_layers,
        encoder_num_layers=job.num_layers,
        decoder_last_pipeline_num_layers=job.last_layers if job.last_layers != job.layers else None,
        hidden_size=HIDDEN,
        num_attention_heads=job.tp,
        num_query_groups=job.tp,
        kv_channels=job.kv,
        ffn_hidden_size=job.ffn * job.tp,
        padded_vocab_size=job.vocab * job.tp,
        max_position_embeddings=job.positions,
        bf16=True,
        fp16=False,
        params_dtype=PARAM_DTYPE,
        accumulate_allreduce_grads_in_fp32=True,
        overlap_grad_reduce=True,
        ddp_bucket_size=job.bucket,
        global_batch_size=args.micro_batch_size * job.dp,
        train_iters=ITERATION,
        save_interval=ITERATION,
        curr_iteration=ITERATION - 1,
        consumed_train_samples=samples,
        save=str(save_dir),
    )
    for name, value in layout.items():
        setattr(args, name, value)
    common["iteration"] = ITERATION
    common["opt_param_scheduler"]["num_steps"] = samples
    common["rerun_state_machine"]["current_iteration"] = ITERATION
    flops = source.common["num_floating_point_operations_so_far"]
    common["num_floating_point_operations_so_far"] = flops * ITERATION / source.common["iteration"]
    return common


# One simulated rank's state dict ---------------------------------------------------------------


class _Group:
    """A process group as megatron-core's helpers ask it (``get_pg_rank``, ``get_pg_size``)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def model_state(job: Job, tp_rank: int, dp_rank: int, pp_rank: int) -> dict:
    """The stage's model as GPTModel.sharded_state_dict gives it, built with megatron-core's own
    helpers: TP-sharded weights with replica id (0, 0, DP rank), TP-replicated ones (0, TP rank,
    DP rank), decoder layers on a prepended layer axis, each layer's extra states as objects.
    The elements are filled in only where the rank saves the tensor (``fill``)."""
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    groups = dict(tp_group=_Group(tp_rank, job.tp), dp_cp_group=_Group(dp_rank, job.dp))
    state, layers = {}, []
    for param in stage_params(job, pp_rank):
        if not param.saved:
            continue
        data = torch.empty(param.shape, dtype=PARAM_DTYPE)
        offsets = () if param.layer is None else ((0, param.layer, job.num_layers),)
        name = param.key if param.layer is None else param.key.replace("layers.", f"layers.{param.layer}.")
        if param.tp_axis is None:
            tensor = make_sharded_tensor_for_checkpoint(data, param.key, prepend_offsets=offsets, **groups)
        else:
            extra = {"allow_shape_mismatch": True} if param.key.startswith("embedding.") else {}
            tensor = make_tp_sharded_tensor_for_checkpoint(
                data, param.key, param.tp_axis, prepend_offsets=offsets, **groups, **extra
            )
        tensor.seed_source = (param, tp_rank)
        state[name] = tensor
        if param.layer is not None and param.layer not in layers:
            layers.append(param.layer)
    for layer in layers:
        for module in _EXTRA_STATES:
            key = f"decoder.layers.{module}._extra_state"
            state[key.replace("layers.", f"layers.{layer}.")] = make_sharded_object_for_checkpoint(
                None, key, ((0, layer, job.num_layers),), replica_id=(0, tp_rank, dp_rank)
            )
    return state


def optimizer_state(job: Job, source: Source, tp_rank: int, dp_rank: int, pp_rank: int, layout) -> dict:
    """DistributedOptimizer.sharded_state_dict in the dp_reshardable layout: the DP rank's slice
    of every bucket, one ShardedTensor per piece and state (replica id (0, 0, 0): every DP rank
    saves its own), and the group's param groups and bucket sizes as objects of DP rank 0."""
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
    )

    prefix = f"optimizer.distributed.dp_group_idx_{pp_rank * job.tp + tp_rank}"  # the MP rank
    replica = (0, 0, dp_rank)
    dtype = (PARAM_DTYPE, GRAD_DTYPE)
    groups = copy.deepcopy(source.param_groups)
    for group in groups["param_groups"]:
        group["step"] = float(ITERATION)
    buckets_state = []
    for index, bucket in enumerate(layout):
        key = f"{prefix}.gbuf_idx_0.dtype_{dtype}.bucket_idx_{index}"
        pieces = []
        for param, start, end, offset in slice_of(bucket, dp_rank, job.dp):
            piece = {}
            for what in ("param", "exp_avg", "exp_avg_sq"):
                data = torch.from_numpy(_values(job, param, tp_rank, start, end, what))
                piece[what] = ShardedTensor(
                    f"{key}.{what}",
                    data,
                    data.dtype,
                    tuple(data.shape),
                    (bucket.unpadded,),
                    (offset,),
                    axis_fragmentations=None,
                    flattened_range=None,
                    allow_shape_mismatch=False,
                    replica_id=(0, 0, 0),
                )
            piece["padding"] = LocalNonpersistentObject(False)
            pieces.append(piece)
        buckets_state.append(pieces)
    numel = [{dtype: [b.padded for b in layout]}]
    unpadded = [{dtype: [b.unpadded for b in layout]}]
    return {
        "optimizer": ShardedObject(f"{prefix}.optimizer", groups, (1,), (0,), replica_id=replica),
        "param_state": {
            "per_bucket_numel": ShardedObject(f"{prefix}.per_bucket_numel", numel, (1,), (0,), replica),
            "per_bucket_numel_unpadded": ShardedObject(
                f"{prefix}.per_bucket_numel_unpadded", unpadded, (1,), (0,), replica
            ),
            0: {dtype: buckets_state},
        },
    }


def rank_state(job: Job, source: Source, common: dict, coords: tuple[int, int, int], layout) -> dict:
    """One rank's sharded state dict as megatron's save gives it to the strategy: Megatron-LM's
    state dict (generate_state_dict) through dist_checkpointing.save's ``save_preprocess``, with
    the rest, the common state, as the object ``common_state`` (saved by rank 0 only)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    tp_rank, dp_rank, pp_rank = coords
    rank = job.rank(tp_rank, dp_rank, pp_rank)
    state = {}
    for key, value in common.items():
        if key == "optimizer":
            value = {**optimizer_state(job, source, tp_rank, dp_rank, pp_rank, layout), **value}
        elif key == "rerun_state_machine":
            rerun = ShardedObject("rerun_state_machine_state", source.rerun, (job.world,), (rank,))
            value = {**value, "sharded": rerun}
        state[key] = value
        if key == "iteration":
            # Without --ckpt-fully-parallel-save a DP rank but the first holds only replicas of
            # the model, which the save drops (replica ids not 0): they are not built.
            built = dp_rank == 0 or job.fully_parallel
            state["model"] = model_state(job, tp_rank, dp_rank, pp_rank) if built else {}
        elif key == "rerun_state_machine":
            rng = ShardedObject(
                "rng_state", source.rng, (job.pp, job.tp), (pp_rank, tp_rank), replica_id=dp_rank
            )
            state["rng_state"] = rng
    sharded, rest = save_preprocess(state, validate_access_integrity=False)
    sharded["common_state"] = ShardedObject("common_state", rest, (1,), (0,), replica_id=rank)
    return sharded


def spread(states: list[dict]) -> None:
    """Megatron-LM's --ckpt-fully-parallel-save over one DP group (FullyParallelSaveStrategyWrapper):
    megatron's greedy distribution of the group's main-replica tensors over its ranks, applied
    by megatron's own function (the metadata exchange it gathers is the list of states)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.exchange_utils import (
        ShardDistribution,
        _shard_size,
        distribute_shards_to_ranks,
    )
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        distribute_main_replicas_with_precomputed_distribution,
    )
    from megatron.core.dist_checkpointing.utils import _sharded_tensor_shard_id

    to_ranks, sizes, metadata, main = {}, {}, {}, set()
    for rank, state in enumerate(states):
        for tensor in nested_values(state):
            if isinstance(tensor, ShardedTensor):
                shard = _sharded_tensor_shard_id(tensor)
                to_ranks.setdefault(shard, []).append(rank)
                sizes.setdefault(shard, _shard_size(tensor))
                metadata.setdefault(shard, tensor)
                if is_main_replica(tensor.replica_id):
                    main.add(shard)
    to_ranks = {shard: ranks for shard, ranks in to_ranks.items() if shard in main}
    saving = distribute_shards_to_ranks(to_ranks, sizes, len(states), set())
    distribution = ShardDistribution(saving, main, metadata, to_ranks)
    for rank, state in enumerate(states):
        distribute_main_replicas_with_precomputed_distribution(state, _Group(rank, len(states)), distribution)


def fill(job: Job, flat: dict) -> None:
    """The elements of the model tensors this rank saves (built empty: most ranks hold replicas
    that are never written)."""
    for tensors in flat.values():
        for tensor in tensors:
            found = getattr(tensor, "seed_source", None)
            if found is not None:
                param, tp_rank = found
                values = torch.from_numpy(_values(job, param, tp_rank, 0, param.numel))
                tensor.data.copy_(values.view(param.shape))


# The save, DP group by DP group -----------------------------------------------------------------


class _FakeWorld:
    """torch.distributed's fake process group as rank ``rank`` of ``world``: what the conversion
    asks (rank, world size) is answered, nothing is communicated."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def __enter__(self):
        dist.init_process_group("fake", rank=self.rank, world_size=self.world)

    def __exit__(self, *exc):
        dist.destroy_process_group()


def _planner():
    """The planner TorchDistSaveShardedStrategy gives every rank (keep_only_main_replica)."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    return MCoreSavePlanner(
        dedup_replicated_tensors=False, flatten_state_dict=False, flatten_sharded_tensors=False
    )


def save_rank(job: Job, rank: int, sharded: dict, directory: Path):
    """One rank's part of TorchDistSaveShardedStrategy.save and save_state_dict_async_plan:
    its main replicas converted, planned by MCoreSavePlanner, its local plan turned into its
    global one without the coordinator (megatron's decentralized planning) and written by
    torch's FileSystemWriter. Returns the local plan and the write results."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    with _FakeWorld(rank, job.world):
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
        fill(job, flat)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
        planner = _planner()
        writer = FileSystemWriter(str(directory), thread_count=1)
        planner.set_up_planner(
            state_dict=pyt_state_dict, storage_meta=writer.storage_meta(), is_coordinator=rank == 0
        )
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        local_plan = writer.prepare_local_plan(planner.create_local_plan())
        plan = planner.create_decentralized_global_plan(local_plan)
        # FileSystemWriterAsync.prepare_decentralized_global_plan: the rank's own file prefix.
        plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{rank}_"))
        results = writer.write_data(planner.finish_plan(plan), planner).value()
    return local_plan, results


def save_group(job: Job, source: Source, common: dict, directory: Path, pp_rank: int, tp_rank: int):
    """The ranks of one model-parallel rank's DP group, one after the other: their states built
    together (the save distribution of --ckpt-fully-parallel-save needs them all), each dropped
    once saved. Returns (rank, local plan, write results) for each."""
    layout = stage_layouts(job)[pp_rank]
    coords = [(tp_rank, dp_rank, pp_rank) for dp_rank in range(job.dp)]
    with _FakeWorld(job.rank(*coords[0]), job.world):  # megatron's helpers ask is_initialized()
        states = [rank_state(job, source, common, c, layout) for c in coords]
        if job.fully_parallel:
            spread(states)
    saved = []
    for dp_rank, c in enumerate(coords):
        rank = job.rank(*c)
        saved.append((rank, *save_rank(job, rank, states[dp_rank], directory)))
        states[dp_rank] = None
    return saved


def _worker() -> None:
    """A saving process: its collector on (each rank's conversion leaves cycles behind, 85 MB a
    DP group of the 1M case), what it inherited frozen so that collecting does not walk it."""
    gc.freeze()
    gc.enable()


def write_checkpoint(job: Job, source: Source, common: dict, directory: Path, progress=None, workers=None):
    """Every rank's file, then ``.metadata`` by the coordinator: the global metadata from all the
    local plans (MCoreSavePlanner.create_global_plan), which megatron keeps in it as
    ``all_local_plans``, and the coordinator writer's ``finish`` with every rank's write results.
    DP groups are saved by ``workers`` processes (default: one per core); only plans and results
    come back."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    plans, results = [None] * job.world, [None] * job.world
    workers = workers or min(os.cpu_count() or 1, 8)
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker) as pool:
        groups = [(pp_rank, tp_rank) for pp_rank in range(job.pp) for tp_rank in range(job.tp)]
        futures = [pool.submit(save_group, job, source, common, directory, *group) for group in groups]
        for done, future in enumerate(as_completed(futures), 1):
            for rank, plan, written in future.result():
                plans[rank], results[rank] = plan, written
            if progress:
                progress(done * job.dp)
    # The coordinator (rank 0): a planner as every rank's, and megatron's writer (a
    # FileSystemWriter): torch's own would record the checkpoint id in .metadata's storage_meta
    # as a PosixPath, megatron's records a str.
    _, metadata = _planner().create_global_plan(plans)
    metadata.all_local_plans = plans  # as save_state_dict_async_plan keeps them
    writer = FileSystemWriterAsync(str(directory), thread_count=1)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    # The plans torch's coordinator would scatter (_save_state_dict): the same prefixes.
    scattered = writer.prepare_global_plan(plans)
    assert all(p.storage_data.prefix == f"__{r}_" for r, p in enumerate(scattered))
    writer.finish(metadata, results)
    return metadata


# The save directory ----------------------------------------------------------------------------


def _quiet() -> None:
    """Megatron warns about every optional extra it lacks, Python about forking a process with
    threads (the savers fork before touching torch's thread pools); torch logs that there is no
    CUDA."""
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    warnings.filterwarnings("ignore", message=r".*fork\(\)", category=DeprecationWarning)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    logging.getLogger("megatron").setLevel(logging.ERROR)


def source_checkpoint() -> Path:
    """The real checkpoint the common state is taken from: the local training job (Megatron-LM's
    pretrain on CPU, 2 ranks) with the distributed optimizer, trained once into data/bench."""
    from tests.bench.bench_verify import checkpoint

    return checkpoint("seed-source", 4, ["--use-distributed-optimizer"])


def make(
    directory: Path,
    *,
    tp: int = 8,
    pp: int = 8,
    dp: int = 80,
    records: int = 100_000,
    seed: int = 0,
    fully_parallel: bool = False,
    source: Path | None = None,
    progress=None,
) -> Path:
    """Make (or find, made with the same parameters) the seed checkpoint in save directory
    ``directory``; return its iteration folder, ``iter_0000100``. ``source``: the real
    checkpoint's iteration folder (default: the local job's, trained once); ``progress`` is told
    how many ranks are saved as DP groups finish."""
    from tasks.checkpoint.layout import MEGATRON_TRACKER, METADATA_JSON, iter_dir_name

    directory = Path(directory)
    iteration = directory / iter_dir_name(ITERATION)
    marker = directory / MARKER
    wanted = dict(tp=tp, pp=pp, dp=dp, records=records, seed=seed, fully_parallel=fully_parallel)
    try:
        if json.loads(marker.read_text())["parameters"] == wanted and iteration.is_dir():
            return iteration
    except (OSError, ValueError, KeyError):
        pass
    _quiet()
    started = time.monotonic()
    job = size_job(tp, pp, dp, records, seed, fully_parallel)
    real = read_source(Path(source) if source else source_checkpoint())
    marker.unlink(missing_ok=True)
    (directory / MEGATRON_TRACKER).unlink(missing_ok=True)
    shutil.rmtree(iteration, ignore_errors=True)
    iteration.mkdir(parents=True)
    collected = gc.isenabled()
    gc.disable()  # here millions of plan items, none in a cycle: collecting them is wasted time
    try:
        metadata = write_checkpoint(job, real, common_state(job, real, directory), iteration, progress)
    finally:
        if collected:
            gc.enable()
    (iteration / METADATA_JSON).write_bytes(real.metadata_json)  # after .metadata, as megatron
    (directory / MEGATRON_TRACKER).write_text(str(ITERATION))
    summary = {
        "parameters": wanted,
        "job": dataclasses.asdict(job),
        "files": job.world,
        "records": len(metadata.storage_data),
        "bytes": sum(f.stat().st_size for f in iteration.iterdir()),
        "seconds": round(time.monotonic() - started, 1),
    }
    marker.write_text(json.dumps(summary, indent=1) + "\n")  # last: the folder is complete
    return iteration


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="the save directory (iter_0000100 is made in it)")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--dp", type=int, default=80)
    parser.add_argument("--records", type=int, default=100_000, help="about how many records")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fully-parallel", action="store_true", help="spread the model over DP ranks")
    parser.add_argument("--source", type=Path, help="a real checkpoint's iteration folder (default: trained)")
    args = parser.parse_args(argv)
    world = args.tp * args.pp * args.dp

    def progress(done: int) -> None:
        print(f"\r{done}/{world} ranks", end="", file=sys.stderr, flush=True)

    iteration = make(
        args.directory,
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        records=args.records,
        seed=args.seed,
        fully_parallel=args.fully_parallel,
        source=args.source,
        progress=progress,
    )
    print(file=sys.stderr)
    summary = json.loads((args.directory / MARKER).read_text())
    print(f"{iteration}")
    for name in ("files", "records", "bytes", "seconds"):
        print(f"{name}: {summary[name]:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
