"""The distributed optimizer's gradient buffers as the checkpoint saved them: its keys are the
authority, the args are hints.

A ``dp_reshardable`` checkpoint stores the distributed optimizer's state bucket by bucket, under
keys that spell out how the job's DDP laid its gradients out::

    optimizer.distributed.dp_group_idx_<mp rank>.gbuf_idx_<buffer>
        .dtype_(<param dtype>, <grad dtype>).bucket_idx_<bucket>.<state>

(one key), each bucket's global size being its unpadded element count. A rebuilt optimizer asks for the
keys and sizes its own DDP makes, which two settings decide: the gradient dtype
(``grad_reduce_in_fp32``) and the bucket size (``overlap_grad_reduce``, ``bucket_size``).
Megatron-LM's args name the first ``accumulate_allreduce_grads_in_fp32``; a Megatron-Core job that
configures DDP in code saves neither, or under names of its own. So both are read from the keys:
the gradient dtype from every buffer's ``dtype_(param, grad)``, and the bucket size as one whose
layout (megatron's own ``compute_full_param_layout`` over the rebuilt parameters) gives this
rank's stored buckets exactly. Expert-parallel buffers, which a separate optimizer holds, are left
to the args.

Import this module only after ``tasks.restore.cpu.install()`` (it imports megatron).
"""

import dataclasses
import re
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from tasks.errors import CkptopsError

PREFIX = "optimizer.distributed."
_BUCKET_KEY = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(?P<group>\d+)\.gbuf_idx_(?P<buffer>\d+)"
    r"\.dtype_\((?P<param>torch\.\w+), (?P<grad>torch\.\w+)\)\.bucket_idx_(?P<bucket>\d+)\.\w+$"
)


class BufferMismatch(CkptopsError):
    """The checkpoint's buffers are not a layout the rebuilt model's parameters can take."""


@dataclass(frozen=True)
class SavedBuffer:
    group: int  # dp_group_idx: the model-parallel rank whose data-parallel group saved it
    index: int  # gbuf_idx
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    buckets: dict[int, int]  # bucket_idx -> its unpadded element count

    @property
    def key(self) -> str:
        return (
            f"{PREFIX}dp_group_idx_{self.group}.gbuf_idx_{self.index}"
            f".dtype_({self.param_dtype}, {self.grad_dtype})"
        )

    def numels(self) -> tuple[int, ...]:
        return tuple(self.buckets[b] for b in sorted(self.buckets))

    def describe(self) -> str:
        return f"{self.key} in buckets of {', '.join(map(str, self.numels()))} elements"


def _dtype(name: str) -> torch.dtype | None:
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


def saved_buffers(tensors: dict) -> dict[int, list[SavedBuffer]]:
    """The buffers of each data-parallel group (by ``dp_group_idx``, each in ``gbuf_idx`` order)
    that the checkpoint's tensor keys (name -> DCP TensorStorageMetadata) describe."""
    found: dict[tuple, dict[int, int]] = {}
    for key, item in tensors.items():
        match = _BUCKET_KEY.match(key)
        if match is None:
            continue
        param, grad = _dtype(match["param"]), _dtype(match["grad"])
        if param is None or grad is None:
            continue
        ident = (int(match["group"]), int(match["buffer"]), param, grad)
        found.setdefault(ident, {})[int(match["bucket"])] = int(item.size[0])
    groups: dict[int, list[SavedBuffer]] = {}
    for (group, index, param, grad), buckets in sorted(found.items(), key=lambda kv: kv[0][:2]):
        groups.setdefault(group, []).append(SavedBuffer(group, index, param, grad, buckets))
    return groups


def grad_reduce_in_fp32(groups: dict[int, list[SavedBuffer]]) -> bool | None:
    """Whether the job reduced its gradients in fp32, as its buffers' dtypes say; None when they
    cannot tell (no buffers, or fp32 parameters, whose gradients are fp32 either way)."""
    said = {
        buffer.grad_dtype == torch.float32
        for buffers in groups.values()
        for buffer in buffers
        if buffer.param_dtype != torch.float32
    }
    if len(said) > 1:
        first = next(b for buffers in groups.values() for b in buffers if b.param_dtype != torch.float32)
        raise BufferMismatch(
            f"{first.key}: the checkpoint's buffers reduce gradients in fp32 and in the "
            "parameters' dtype at once; no DDP config saves both"
        )
    return said.pop() if said else None


@dataclass
class Fitted:
    ddp_config: object  # megatron's DistributedDataParallelConfig, as the checkpoint saved
    notes: list[str]


def _layout(params, bucket_size, data_parallel: int, ddp_config) -> list[tuple]:
    layouts = DistributedOptimizer.compute_full_param_layout(params, bucket_size, data_parallel, ddp_config)
    return [
        (key.param_dtype, key.grad_dtype, tuple(layout.per_bucket_numel_unpadded))
        for key, layout in layouts.layouts.items()
        if not key.is_expert_parallel
    ]


def fit(ddp_config, params: list, groups: dict[int, list[SavedBuffer]]) -> Fitted:
    """``ddp_config`` with the gradient dtype and bucket size the checkpoint's buffers were made
    with (after ``init_distributed``; ``params`` in the order DDP meets them). Raises
    ``BufferMismatch`` when no bucket size lays this rank's parameters out as they were saved."""
    notes = []
    fp32 = grad_reduce_in_fp32(groups)
    if fp32 is not None and fp32 != ddp_config.grad_reduce_in_fp32:
        dtype = "fp32" if fp32 else "the parameters' dtype"
        notes.append(
            f"gradients reduced in {dtype} (grad_reduce_in_fp32={fp32}), as the checkpoint's buffer keys "
            f"say; the args imply grad_reduce_in_fp32={ddp_config.grad_reduce_in_fp32}"
        )
        ddp_config = dataclasses.replace(ddp_config, grad_reduce_in_fp32=fp32)
    group = torch.distributed.get_rank(parallel_state.get_model_parallel_group())
    saved = groups.get(group)
    if not saved:
        return Fitted(ddp_config, notes)
    first_gap = next((b for b in saved if sorted(b.buckets) != list(range(len(b.buckets)))), None)
    if first_gap is not None:
        missing = next(i for i in range(len(first_gap.buckets) + 1) if i not in first_gap.buckets)
        raise BufferMismatch(
            f"{first_gap.key}.bucket_idx_{missing}: not in the checkpoint, which holds buckets "
            f"{', '.join(map(str, sorted(first_gap.buckets)))} of that buffer"
        )
    wanted = [(b.param_dtype, b.grad_dtype, b.numels()) for b in saved]
    data_parallel = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    closed = sorted({n for b in saved for n in b.numels()[:-1]})
    for size in [None, *closed]:
        candidate = dataclasses.replace(ddp_config, overlap_grad_reduce=size is not None, bucket_size=size)
        if _layout(params, size, data_parallel, candidate) == wanted:
            if size != (ddp_config.bucket_size if ddp_config.overlap_grad_reduce else None):
                notes.append(
                    f"gradients in {len(wanted[0][2])} buckets (overlap_grad_reduce={size is not None}, "
                    f"bucket_size={size}), as the checkpoint's buffer keys say"
                )
            return Fitted(candidate, notes)
    made = _layout(params, None, data_parallel, ddp_config)
    raise BufferMismatch(
        f"{saved[0].describe()}: no bucket size lays the rebuilt model's parameters out so (they "
        f"make {' | '.join(f'dtype_({p}, {g}) of {sum(n)} elements' for p, g, n in made) or 'no buffer'})"
    )
