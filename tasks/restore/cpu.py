"""Lets Megatron-Core 0.19 build, load and train on a machine without a GPU.

Imported by the drill's loader and by the local training job before megatron; every patch below
is applied only when ``torch.cuda.is_available()`` is false, so the same code runs unchanged on a
GPU (a drill allocation) and on CPU ranks (tests, the embedded default). Megatron-Core hard-codes
CUDA on its training and checkpoint paths (synchronize, streams, the CUDA RNG, ``device="cuda"``
tensors); each patch maps one of those to its CPU meaning.
"""

import contextlib
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

ACTIVE = not torch.cuda.is_available()


def _to_cpu(device):
    """Map any CUDA device spelling (``"cuda"``, ``"cuda:0"``, ``0``, a torch.device) to CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device=`` arguments, ``.cuda()`` and ``.to("cuda")`` to the CPU, and answers
    ``tensor.type()`` with the CUDA type name that megatron's type-string checks expect."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


class _NoStream:
    """A CUDA stream stand-in: CPU work is already ordered, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


def _stub_triton_paged_stash():
    """Megatron 0.19 imports triton unguarded in one MoE module; stub that module only.

    A fake top-level ``triton`` would break ``torch._inductor``, so only the megatron module
    that needs it is replaced, and only where triton itself cannot be imported.
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        name = "megatron.core.transformer.moe.ops.paged_stash"
        sys.modules[name] = types.ModuleType(name)


def _eager(model=None, **options):
    """``torch.compile`` that compiles nothing: as a decorator, with or without options."""
    return model if model is not None else (lambda function: function)


def install():
    """Apply the CPU patches once per process, whichever copy of this module asks (a module run
    afresh in a forked interpreter must not stack a second device mode); nothing where CUDA is
    available."""
    if not ACTIVE or getattr(torch.cuda, "ckptops_cpu_patches", False):
        return
    torch.cuda.ckptops_cpu_patches = True
    # Megatron-Core's jit_fuser is torch.compile, which every CPU rank here runs eagerly (its
    # fused functions are tiny; inductor would compile C++ for each): the function itself does
    # that without importing dynamo and inductor, about 2.7 s of each process's start.
    torch.compile = _eager
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: 0
    torch.cuda.empty_cache = lambda: None
    torch.cuda.Stream = _NoStream
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    _stub_triton_paged_stash()

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _CudaToCpu().__enter__()
