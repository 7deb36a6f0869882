"""The local training job: Megatron-LM's own training loop, ``megatron.training.pretrain``.

Run it with torchrun and Megatron-LM's own arguments (gloo on CPU, nccl where CUDA is available):

    torchrun --standalone --nproc_per_node 2 infra/local_job/pretrain.py --save DIR --train-iters 12 ...

This file is the entry Megatron-LM's repository scripts (pretrain_gpt.py) are for a user's job:
a GPT model provider (Megatron-Core ``GPTModel``, local layer spec), a ``forward_step`` and a
datasets provider (``MockGPTDataset`` over 4,000 mock documents with ``--mock-data``, the real
``GPTDataset`` with ``--data-path``). Everything else (arguments, checkpointing, logging, timers,
signals, exit codes) is Megatron-LM's. ckptops' own switches (step records, faults, the
saved-checkpoint event) are parsed as extra arguments and act inside ``forward_step`` or around
the loop, so a failure comes out of the real loop and torchrun as it would on a cluster.
"""

import os
import sys
from functools import partial

if __name__ == "__main__":  # as a script: the repository root, for tasks.restore.cpu and ckptops_records
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

# megatron.training imports NVIDIA ModelOpt where it is installed (Megatron-Bridge's fixtures
# install it), about 7 CPU-s per rank, then finds no megatron.post_training in megatron-core's
# package and leaves ModelOpt off: this job goes straight to the same result.
sys.modules.setdefault("modelopt", None)

from infra.local_job import cpu_loop  # noqa: E402

cpu_loop.install()  # before megatron.training is imported; does nothing on a GPU

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402

from infra.local_job import dataset, faults, flight_recorder, records  # noqa: E402
from tasks.restore.build import gpt_provider, ranks_from_slurm  # noqa: E402


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Megatron-LM's GPT builder for the local layer spec (the one the drill's loader builds)."""
    args = get_args()
    return gpt_provider(
        args, pre_process, post_process, vp_stage, config=core_transformer_config_from_args(args)
    )


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Megatron-LM's GPT loss: the masked sum, the token count, and what the log reports."""
    losses = output.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1)])}


def get_batch(data_iterator) -> dict | None:
    """The micro-batch, read on the tensor-parallel group's first rank and broadcast to the
    others; only the first and last pipeline stages use data."""
    if not (parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()):
        return None
    data = next(data_iterator) if parallel_state.get_tensor_model_parallel_rank() == 0 else None
    batch = tensor_parallel.broadcast_data(["tokens", "labels", "position_ids"], data, torch.int64)
    batch |= tensor_parallel.broadcast_data(["loss_mask"], data, torch.float32)
    batch |= tensor_parallel.broadcast_data(["attention_mask"], data, torch.bool)
    return batch


def forward_step(data_iterator, model: GPTModel):
    batch = get_batch(data_iterator)
    if batch is None:  # a middle pipeline stage: its input is the previous stage's output
        return model(None, None, None), partial(loss_func, None)
    records.saw_batch(batch["tokens"])
    faults.before_forward(model)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return faults.after_forward(output), partial(loss_func, batch["loss_mask"])


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    return dataset.datasets(get_args(), get_tokenizer(), train_val_test_num_samples)


datasets_provider.is_distributed = True


# The local tiny job's settings, before the command line's own (which win: argparse keeps the
# last value): a 2-layer GPT of hidden size 64 over a 128-token vocabulary, global batch 8 of
# sequences of 32, Adam at 1e-3 decaying linearly to 1e-4 over 1,250 iterations after 2 of
# warm-up, no dropout (a correct resume is then bit-exact on CPU too), a log line per iteration.
TINY = [
    "--num-layers=2",
    "--hidden-size=64",
    "--num-attention-heads=4",
    "--seq-length=32",
    "--micro-batch-size=2",
    "--global-batch-size=8",
    "--lr=1e-3",
    "--min-lr=1e-4",
    "--lr-warmup-iters=2",
    "--lr-decay-iters=1250",
    "--hidden-dropout=0",
    "--attention-dropout=0",
    "--tokenizer-type=NullTokenizer",
    "--vocab-size=128",
    "--log-interval=1",
    "--eval-interval=1000000",  # needed even with no evaluation: train_iters // eval_interval
    "--eval-iters=0",
    "--ckpt-format=torch_dist",
    "--seed=1234",
]
# What Megatron-LM needs on CPU ranks (shared/notes/megatron-lm-on-cpu.md); nothing on a GPU.
CPU = [
    "--distributed-backend=gloo",
    "--transformer-impl=local",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-persist-layer-norm",
    "--no-rope-fusion",
]


def extra_args(parser):
    records.add_arguments(parser)
    faults.add_arguments(parser)
    parser.add_argument(
        "--distributed-timeout-seconds",
        type=float,
        default=None,
        help="ckptops: Megatron-LM's --distributed-timeout-minutes in seconds (a rehearsed hang ends sooner)",
    )
    return parser


def _given(argv: list[str], flag: str) -> str | None:
    """The last value ``argv`` gives ``flag`` (``--flag V`` or ``--flag=V``), or None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def command_line(argv: list[str]) -> list[str]:
    """The tiny job's settings (and the CPU's), then the command line; mock data unless the
    command line names a dataset; position embeddings as long as the sequence unless given."""
    data = [] if any(a.startswith(("--data-path", "--mock-data")) for a in argv) else ["--mock-data"]
    tiny = TINY + CPU if cpu_loop.ACTIVE else list(TINY)
    if _given(argv, "--max-position-embeddings") is None:
        tiny.append(
            f"--max-position-embeddings={_given(argv, '--seq-length') or _given(TINY, '--seq-length')}"
        )
    return tiny + data + argv


def main() -> None:
    ranks_from_slurm()  # under srun, one task per rank
    sys.argv[1:] = command_line(sys.argv[1:])
    args = parse_and_validate_args(extra_args_provider=extra_args)
    if args.distributed_timeout_seconds is not None:
        args.distributed_timeout_minutes = args.distributed_timeout_seconds / 60
    # The checkpoint writer otherwise starts a *spawn* Manager at the first save (7-14 s here, a
    # Python importing torch); a fork-context queue made before the process group exists costs
    # well under a second.
    filesystem_async.get_write_results_queue(mp_mode="fork")
    records.start(args)
    faults.start(args)
    flight_recorder.start()
    try:
        pretrain(
            pretrain_cfg_container_from_args(args),
            datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            model_provider=model_provider,
        )
    except BaseException:
        flight_recorder.dump()
        raise
    records.finish()


if __name__ == "__main__":
    main()
