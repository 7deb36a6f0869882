"""What Megatron-LM's training loop needs on a machine without a GPU (tests, the demo).

On top of ``tasks.restore.cpu`` (Megatron-Core on CPU), the stand-ins for the places where
``megatron.training`` asks CUDA for something a CPU rank does not have (see
shared/notes/megatron-lm-on-cpu.md). Like that module, nothing here is active where CUDA is
available: the same entry script runs unchanged on a GPU.
"""

import contextlib
import os

import torch

from tasks.restore import cpu

ACTIVE = cpu.ACTIVE


def install() -> None:
    """The environment every time, the patches once per process (as ``cpu.install``); nothing
    where CUDA is available."""
    if not cpu.ACTIVE:
        return
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # jit_fuser is torch.compile: run eagerly
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # what TP > 1 requires before Blackwell
    os.environ.setdefault("NO_VCS_VERSION", "1")  # or the version printed carries this checkout's hash
    if getattr(torch.cuda, "ckptops_cpu_loop_patches", False):
        return
    torch.cuda.ckptops_cpu_loop_patches = True
    cpu.install()
    # Model-parallel set-up and the model-parallel RNG seed run only with a device; set_device
    # then has nothing to select.
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

    from megatron.training import arguments, initialize, training

    arguments.get_device_arch_version = lambda: 0  # pre-Blackwell: as a Hopper cluster
    original = initialize.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        return original(*args, **{**kwargs, "allow_no_cuda": True})

    initialize.initialize_megatron = training.initialize_megatron = initialize_megatron
    initialize._compile_dependencies = _helpers_prebuilt
    _rerun_sees_devices()


# The GPU a rank runs on, as Megatron's rerun state machine records it (a rerun on another GPU
# is one on another node or device): on CPU every rank's device is 0, so a relaunch could never
# land elsewhere. The stand-in: the rank's local rank, offset by this variable, which a test sets
# for a relaunch that a cluster would place on other GPUs (recovery's --exclude of the node).
DEVICE_BASE_ENV = "CKPTOPS_CPU_DEVICE_BASE"


class _Devices:
    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> int:
        return int(os.environ.get("LOCAL_RANK", "0")) + int(os.environ.get(DEVICE_BASE_ENV, "0"))


class _TorchForRerun:
    """torch, but for the device index the rerun state machine asks for (only it sees this)."""

    cuda = _Devices()

    def __getattr__(self, name):
        return getattr(torch, name)


def _rerun_sees_devices() -> None:
    from megatron.core import rerun_state_machine

    rerun_state_machine.torch = _TorchForRerun()


def _helpers_prebuilt() -> None:
    """The wheel ships the dataset helpers compiled and no Makefile to build them with: use them
    (on any machine: a GPU job from the wheel meets this too)."""
    from megatron.core.datasets import helpers_cpp  # noqa: F401
