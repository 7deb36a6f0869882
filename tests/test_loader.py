"""The loader's parts without a process group: the model a checkpoint's args and tensor shapes
describe, the comparison of loaded pieces with the stored bytes after resharding, the
optimizer's param groups and gradient buffers taken from what the checkpoint saved; and the real
load of a Megatron-Core job's checkpoint whose buffers its args do not describe."""

import argparse
import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tasks.checkpoint.dcp import build_index, load_common_state, load_dcp_metadata
from tasks.checkpoint.promote import promote
from tasks.cluster import process
from tasks.profile import load_profile
from tasks.restore import buffers, param_groups
from tasks.restore.compare import compare
from tasks.restore.drill import run_drill
from tasks.restore.launch import LoaderShape, loader_env, torchrun
from tasks.restore.model_args import ModelArgsError, resolve
from tasks.restore.report import first_error
from tests.conftest import iter_dir, variant_profile


def index_and_args(directory):
    index = build_index(load_dcp_metadata(directory / ".metadata"))
    return index, load_common_state(directory, index)["args"]


def test_the_jobs_own_args_need_no_inference(variety):
    for name in ("tp2-distopt-bf16", "pp2", "llama-like"):
        index, args = index_and_args(iter_dir(variety[name], 4))
        resolved = resolve(args, index.tensors)
        assert resolved.inferred == [], name
    index, args = index_and_args(iter_dir(variety["llama-like"], 4))
    got = resolve(args, index.tensors).args
    assert (
        got.swiglu,
        got.normalization,
        got.position_embedding_type,
        got.group_query_attention,
        got.num_query_groups,
        got.untie_embeddings_and_output_weights,
        got.add_bias_linear,
        got.qk_layernorm,
    ) == (True, "RMSNorm", "rope", True, 2, True, False, True)


def test_shapes_win_over_missing_and_contradicting_args(variety):
    index, args = index_and_args(iter_dir(variety["llama-like"], 4))
    stripped = argparse.Namespace(
        num_attention_heads=4,
        seq_length=32,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        hidden_size=999,
        swiglu=False,
    )
    resolved = resolve(stripped, index.tensors)
    got = resolved.args
    assert (got.hidden_size, got.num_layers, got.ffn_hidden_size, got.swiglu, got.kv_channels) == (
        64,
        2,
        128,
        True,
        16,
    )
    notes = "\n".join(resolved.inferred)
    assert (
        "hidden_size=64 (the args say 999; embedding.word_embeddings.weight [128, 64] says otherwise)"
        in notes
    )
    assert "swiglu=True (the args say False; decoder.layers.mlp.linear_fc1.weight [2, 256, 64]" in notes
    assert "normalization='RMSNorm' (missing from the args; from norm biases absent)" in notes
    assert (
        "num_layers=2 (missing from the args; from decoder.layers.self_attention.linear_qkv.weight" in notes
    )
    assert "max_position_embeddings=32 (Megatron-LM's default: seq_length)" in notes
    assert args.hidden_size == 64  # the checkpoint's own args are not modified


def test_an_arg_the_shapes_cannot_settle_is_named(variety):
    index, args = index_and_args(iter_dir(variety["pp2"], 4))
    with pytest.raises(
        ModelArgsError, match=r"^args.num_attention_heads: missing from the checkpoint's args"
    ):
        resolve(argparse.Namespace(), index.tensors)
    with pytest.raises(ModelArgsError, match="kv_channels=48: does not divide the query width 64"):
        resolve(argparse.Namespace(num_attention_heads=4, kv_channels=48), index.tensors)
    not_gpt = {k: v for k, v in index.tensors.items() if not k.startswith("decoder.layers.self_attention")}
    with pytest.raises(
        ModelArgsError, match="linear_qkv.weight: not in the checkpoint; not a Megatron-Core GPT"
    ):
        resolve(args, not_gpt)


@dataclass
class Piece:
    """What a rank holds of a global tensor, as megatron's ShardedTensor describes it."""

    key: str
    data: torch.Tensor
    global_shape: tuple
    global_offset: tuple
    local_shape: tuple
    flattened_range: slice | None = None


def test_a_resharded_piece_is_assembled_from_the_stored_chunks_and_compared_bit_for_bit(variety, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = iter_dir(variety["tp2-bf16"], 4)
    index, _ = index_and_args(directory)
    # PyTorch's own DCP reader (our checkpoint, so its full unpickling is safe here) gives the
    # expected values: whole tensors, put together by code that is not ours.
    dcp_to_torch_save(directory, tmp_path / "whole.pt")
    full = torch.load(tmp_path / "whole.pt", weights_only=False)
    key = "decoder.layers.mlp.linear_fc1.weight"
    assert len(index.tensors[key].chunks) == 4  # saved as 2 layers x 2 tensor-parallel halves
    # On TP1 a rank holds a whole layer: both stored halves; on TP4 a quarter of one.
    whole = Piece(key, full[key][1].clone(), (2, 256, 64), (1, 0, 0), (256, 64))
    quarter = Piece(key, full[key][0, 64:128].clone(), (2, 256, 64), (0, 64, 0), (64, 64))
    flat = Piece(
        key, full[key][0].flatten()[100:300].clone(), (2, 256, 64), (0, 0, 0), (256, 64), slice(100, 300)
    )
    compared, mismatches = compare(directory, index, [whole, quarter, flat])
    assert compared == [f"{key}@[1, 0, 0]", f"{key}@[0, 64, 0]", f"{key}@[0, 0, 0]"] and mismatches == []
    whole.data.view(torch.int16)[5, 7] ^= 1  # one bit of one bf16 value
    quarter.data = quarter.data.float()  # right values, wrong dtype
    assert compare(directory, index, [whole, quarter, flat])[1] == [f"{key}@[1, 0, 0]", f"{key}@[0, 64, 0]"]
    missing = Piece("decoder.layers.mlp.linear_fc9.weight", whole.data, (2, 256, 64), (1, 0, 0), (256, 64))
    assert compare(directory, index, [missing])[1] == [
        "decoder.layers.mlp.linear_fc9.weight@[1, 0, 0] (not all of it is in the checkpoint)"
    ]


def test_a_mixture_of_experts_is_recognised_by_its_router(variety):
    """The local job cannot train MoE on CPU (megatron-core's router fails in autograd there), so
    the shapes of a MoE checkpoint are those of the dense job plus a router, as megatron names it."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    index, args = index_and_args(iter_dir(variety["pp2"], 4))
    dense = {k: v for k, v in index.tensors.items() if ".mlp.linear_fc" not in k}
    router = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([2, 8, 64]),
        [ChunkStorageMetadata(torch.Size([0, 0, 0]), torch.Size([2, 8, 64]))],
    )
    resolved = resolve(args, {**dense, "decoder.layers.mlp.router.weight": router})
    assert resolved.args.num_experts == 8 and resolved.args.moe_router_topk == 2
    assert resolved.inferred == [
        "num_experts=8 (the args say None; decoder.layers.mlp.router.weight [2, 8, 64] says otherwise)"
    ]


def built_groups(args, *, expert: bool = False, extra: bool = False) -> list[dict]:
    """The groups megatron's ``_get_param_groups`` builds from a job's args (its standard
    overrides: weight decay off for biases and 1-dim parameters), on a real torch Adam."""
    weights, biases = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    common = {"lr_mult": 1.0, "is_decoupled_lr": False, "is_expert_parallel": False}
    common |= {"max_lr": args.lr, "min_lr": getattr(args, "min_lr", None)}
    groups = [{"params": [weights], "wd_mult": 1.0, **common}, {"params": [biases], "wd_mult": 0.0, **common}]
    if expert:  # the biases in a group of expert parameters
        groups[1]["is_expert_parallel"] = True
    if extra:
        groups.append(
            {"params": [torch.nn.Parameter(torch.ones(2))], **common, "wd_mult": 1.0, "max_lr": 0.5}
        )
    return torch.optim.Adam(groups, lr=args.lr).param_groups


def inner(groups: list[dict]) -> list:
    """The chain of optimizers as megatron holds it: one, whose torch optimizer has the groups."""
    return [SimpleNamespace(optimizer=SimpleNamespace(param_groups=groups))]


def own_groups_state(variety):
    directory = iter_dir(variety["own-loop-groups"], 4)
    index = build_index(load_dcp_metadata(directory / ".metadata"))
    common = load_common_state(directory, index)
    return common["optimizer"], common["args"]


def test_the_saved_param_groups_win_over_what_the_args_imply(variety):
    state, args = own_groups_state(variety)
    current = built_groups(args)
    notes = param_groups.adopt(inner(current), state, args)
    saved = param_groups.saved_groups(state, 1)[0]
    assert [param_groups.identifier(g) for g in current] == [param_groups.identifier(g) for g in saved]
    # The loop's own values (3 x and 1.5 x its --lr, half its --min-lr), each named with its arg.
    assert (
        "optimizer 0 group 0: max_lr 0.003 from the checkpoint (the args imply 0.001: max_lr from --lr 0.001)"
        in notes
    )
    assert "optimizer 0 group 1: max_lr 0.0015 from the checkpoint" in " | ".join(notes)
    assert any(n.startswith("optimizer 0 group 0: min_lr 5e-05") for n in notes)


def test_args_without_min_lr_take_the_saved_one_and_say_so(variety):
    state, args = own_groups_state(variety)
    args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "min_lr"})
    current = built_groups(args)
    notes = param_groups.adopt(inner(current), state, args)
    assert current[0]["min_lr"] == 5e-05
    assert "min_lr from --min-lr, which the checkpoint's args do not hold" in " | ".join(notes)


def test_a_group_the_checkpoint_lacks_fails_naming_its_key_and_arg(variety):
    state, args = own_groups_state(variety)
    current = built_groups(args, expert=True)
    with pytest.raises(param_groups.ParamGroupMismatch) as raised:
        param_groups.adopt(inner(current), state, args)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("optimizer param group (end_wd=None, max_lr=0.001, ")
    assert "is_expert_parallel=True" in message and "from --expert-model-parallel-size" in message
    assert "the checkpoint's groups: end_wd=None, max_lr=0.003" in message


def test_groups_are_paired_one_to_one_or_not_at_all(variety):
    state, args = own_groups_state(variety)
    # A group more than the checkpoint saved: no saved group may be left over or used twice.
    with pytest.raises(
        param_groups.ParamGroupMismatch,
        match="the args build 3 optimizer param groups, the checkpoint saved 2",
    ):
        param_groups.adopt(inner(built_groups(args, extra=True)), state, args)
    # Two saved groups of one shape, neither with the built group's key: a guess, refused.
    saved = param_groups.saved_groups(state, 1)[0]
    twins = [dict(saved[0]), dict(saved[0], max_lr=0.007)]
    current = [dict(g) for g in built_groups(args)[:1]] * 2
    with pytest.raises(param_groups.ParamGroupMismatch, match="could be any of 2 saved groups of its shape"):
        param_groups.adopt(inner(current), {"param_groups": twins}, args)


FOREIGN = "core-fp32-grads"  # a Megatron-Core loop's DDP configured in code (tests/conftest.py)
BUCKET = "optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_1"


def test_the_gradient_buffers_are_read_from_the_checkpoints_keys(variety):
    index, args = index_and_args(iter_dir(variety[FOREIGN], 4))
    # Its args say nothing of how it reduced its gradients: neither Megatron-LM's name nor megatron-core's.
    assert not {"accumulate_allreduce_grads_in_fp32", "grad_reduce_in_fp32"} & set(vars(args))
    groups = buffers.saved_buffers(index.tensors)
    assert sorted(groups) == [0, 1]  # one data-parallel group per tensor-parallel rank
    (buffer,) = groups[1]
    assert (buffer.param_dtype, buffer.grad_dtype, len(buffer.buckets)) == (torch.bfloat16, torch.float32, 3)
    assert sum(buffer.numels()) == sum(buffers.saved_buffers(index.tensors)[0][0].numels())
    assert buffers.grad_reduce_in_fp32(groups) is True
    # Megatron-LM's own loop: one bucket per buffer, fp32 gradients as its args say too.
    index, args = index_and_args(iter_dir(variety["tp2-distopt-bf16"], 4))
    groups = buffers.saved_buffers(index.tensors)
    assert [len(b.buckets) for g in groups.values() for b in g] == [1, 1]
    assert buffers.grad_reduce_in_fp32(groups) is args.accumulate_allreduce_grads_in_fp32 is True


def test_a_megatron_core_jobs_checkpoint_drills_on_its_own_buffers(variety, tmp_path, options):
    profile = load_profile(variant_profile(variety, FOREIGN, tmp_path))
    promote(profile.job.save_dir, options, 30)
    report = run_drill(profile, "shared")
    assert report.ok, report.reason
    model = next(c for c in report.checks if c.name == "model").detail
    assert "on TP 2 x PP 1 x DP 1 (2 ranks)" in model and "optimizer loaded (dp_reshardable)" in model
    assert (
        "gradients reduced in fp32 (grad_reduce_in_fp32=True), as the checkpoint's buffer keys say; "
        "the args imply grad_reduce_in_fp32=False"
    ) in model
    assert "gradients in 3 buckets (overlap_grad_reduce=True, bucket_size=" in model
    load = json.loads(Path(report.log).with_suffix(".load.json").read_text())
    assert len(load["ranks"]) == 2 and all(r["compared"] and not r["mismatches"] for r in load["ranks"])
    assert all(any(".bucket_idx_" in key for key in r["compared"]) for r in load["ranks"])


def without(source: Path, target: Path, keys: list[str]) -> Path:
    """A copy of the checkpoint whose ``.metadata`` no longer lists ``keys`` (their bytes stay)."""
    shutil.copytree(source, target)
    metadata = load_dcp_metadata(target / ".metadata")
    for key in keys:
        del metadata.state_dict_metadata[key]
        for index in [i for i in metadata.storage_data if i.fqn == key]:
            del metadata.storage_data[index]
    with open(target / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return target


def load_error(checkpoint: Path) -> str:
    """The real loader on the checkpoint's own layout (TP 2): the error the first failing rank wrote."""
    report = checkpoint.parent / f"{checkpoint.name}.load.json"
    arguments = ["--checkpoint", str(checkpoint), "--report", str(report)]
    with pytest.raises(process.Failed):
        command = torchrun(LoaderShape(2, 1, 2), arguments)
        process.run(command, report.with_suffix(".log"), 300, loader_env(), "the load")
    return first_error(report)["error"]


def test_a_key_the_checkpoint_lacks_is_one_line_naming_it(variety, tmp_path):
    source = iter_dir(variety[FOREIGN], 4)
    error = load_error(without(source, tmp_path / "one-state", [f"{BUCKET}.exp_avg_sq"]))
    assert error.startswith(
        f"{BUCKET}.exp_avg_sq: not in the checkpoint, and the rebuilt model and optimizer ask for it; "
        f"the checkpoint holds {BUCKET.rsplit('.', 1)[0]} in buckets of "
    )
    assert "\n" not in error and len(error) < 400
    # A whole bucket gone: no bucket size lays the parameters out so; the missing one is named.
    gone = [f"{BUCKET}.{state}" for state in ("param", "exp_avg", "exp_avg_sq")]
    error = load_error(without(source, tmp_path / "one-bucket", gone))
    assert error == f"{BUCKET}: not in the checkpoint, which holds buckets 0, 2 of that buffer"
