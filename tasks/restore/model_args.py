"""The model a checkpoint describes: Megatron-LM's arguments, checked against the tensors it holds.

A restore drill must rebuild the job's model and optimizer before it can load anything, and it
must do so for jobs ckptops never trained. The checkpoint carries the job's Megatron-LM ``args``
(in its common state) and, in DCP's ``.metadata``, the global shape and dtype of every tensor.
The args say what the job meant; the shapes say what was saved. Where an arg is missing, or
disagrees with the shapes, the shapes win and the resolution says which arg was inferred and
from which tensor, so a drill report shows exactly what was guessed. An arg the shapes cannot
settle (the number of attention heads, when nothing else pins it) and the args do not give is
an error naming that arg.

Only arguments that change which parameters exist, or their shapes and dtypes, are resolved
here; fusions, recomputation and the like change how a model runs, never what it loads.
Argument names and defaults are Megatron-LM's (``megatron/training/arguments.py`` and the
``TransformerConfig`` fields it exposes).
"""

import argparse
import copy
from dataclasses import dataclass, field

import torch

from tasks.errors import CkptopsError

# Checkpoint keys of a Megatron-Core GPT (Transformer Engine names; megatron-core's local layer
# spec maps its own module names onto these when it saves and loads, so both read the same).
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
QKV = "decoder.layers.self_attention.linear_qkv.weight"
QKV_BIAS = "decoder.layers.self_attention.linear_qkv.bias"
PROJ = "decoder.layers.self_attention.linear_proj.weight"
PROJ_BIAS = "decoder.layers.self_attention.linear_proj.bias"
Q_NORM = "decoder.layers.self_attention.q_layernorm.weight"
INPUT_NORM_BIAS = "decoder.layers.self_attention.linear_qkv.layer_norm_bias"
FC1 = "decoder.layers.mlp.linear_fc1.weight"
FC2 = "decoder.layers.mlp.linear_fc2.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
FINAL_NORM_BIAS = "decoder.final_layernorm.bias"
OUTPUT = "output_layer.weight"
ROUTER = "decoder.layers.mlp.router.weight"

# Megatron-LM's defaults for the arguments that shape the parameters.
DEFAULTS = {
    "group_query_attention": False,
    "num_query_groups": 1,
    "kv_channels": None,
    "ffn_hidden_size": None,
    "position_embedding_type": "learned_absolute",
    "normalization": "LayerNorm",
    "norm_epsilon": 1e-5,
    "swiglu": False,
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "untie_embeddings_and_output_weights": False,
    "qk_layernorm": False,
    "num_experts": None,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": None,
    "rotary_percent": 1.0,
    "rotary_base": 10000,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "use_distributed_optimizer": False,
    "bf16": False,
    "fp16": False,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
    "apply_layernorm_1p": False,
    "no_save_optim": False,
    "no_save_rng": False,
}

_FLOAT16 = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class ModelArgsError(CkptopsError):
    """The checkpoint's args cannot build its model: one arg missing or contradicted."""


@dataclass
class ResolvedArgs:
    args: argparse.Namespace
    inferred: list[str] = field(default_factory=list)  # "arg: value (why)" for every guess

    def note(self, name: str, value, why: str) -> None:
        setattr(self.args, name, value)
        self.inferred.append(f"{name}={value!r} ({why})")


def _shape(tensors: dict, key: str) -> tuple[int, ...] | None:
    item = tensors.get(key)
    return None if item is None else tuple(int(d) for d in item.size)


def _dtype(tensors: dict, key: str):
    item = tensors.get(key)
    return None if item is None else item.properties.dtype


class _Resolver:
    def __init__(self, stored, tensors: dict):
        self.tensors = tensors
        base = vars(copy.deepcopy(stored)) if stored is not None else {}
        self.given = set(base)
        self.out = ResolvedArgs(argparse.Namespace(**{**DEFAULTS, **base}))

    @property
    def args(self) -> argparse.Namespace:
        return self.out.args

    def settle(self, name: str, value, source: str) -> None:
        """The shapes say ``name`` is ``value``: keep the arg if it agrees, else record why not."""
        current = getattr(self.args, name, None)
        if name not in self.given:
            self.out.note(name, value, f"missing from the args; from {source}")
        elif current != value:
            self.out.note(name, value, f"the args say {current!r}; {source} says otherwise")

    def require(self, name: str, why: str):
        value = getattr(self.args, name, None)
        if value is None:
            raise ModelArgsError(f"args.{name}: missing from the checkpoint's args, and {why}")
        return value

    def run(self) -> ResolvedArgs:
        t = self.tensors
        embeddings = _shape(t, WORD_EMBEDDINGS)
        qkv, proj = _shape(t, QKV), _shape(t, PROJ)
        if embeddings is None or qkv is None or proj is None:
            missing = next(
                k for k, s in ((WORD_EMBEDDINGS, embeddings), (QKV, qkv), (PROJ, proj)) if s is None
            )
            raise ModelArgsError(
                f"{missing}: not in the checkpoint; not a Megatron-Core GPT (name the job's "
                "model builder in drill.model_provider)"
            )
        self.settle("padded_vocab_size", embeddings[0], f"{WORD_EMBEDDINGS} {list(embeddings)}")
        self.settle("hidden_size", embeddings[1], f"{WORD_EMBEDDINGS} {list(embeddings)}")
        self.settle("num_layers", qkv[0], f"{QKV} {list(qkv)}")
        self._attention(qkv, proj)
        self._mlp()
        self._positions()
        self._norms_and_biases()
        self._precision()
        self._parallel_sizes()
        return self.out

    def _attention(self, qkv, proj) -> None:
        t = self.tensors
        q_norm = _shape(t, Q_NORM)
        self.settle("qk_layernorm", q_norm is not None, f"{Q_NORM} {'present' if q_norm else 'absent'}")
        query_width = proj[2]  # heads x kv_channels
        if q_norm is not None:
            self.settle("kv_channels", q_norm[1], f"{Q_NORM} {list(q_norm)}")
        kv = getattr(self.args, "kv_channels", None)
        heads = getattr(self.args, "num_attention_heads", None)
        if kv is None and heads:
            kv = query_width // heads
            self.settle("kv_channels", kv, f"{PROJ} {list(proj)} / num_attention_heads {heads}")
        if kv is None:
            self.require("num_attention_heads", "the tensor shapes cannot tell the number of heads")
        if query_width % kv:
            raise ModelArgsError(
                f"args.kv_channels={kv}: does not divide the query width {query_width} of {PROJ}"
            )
        self.settle("num_attention_heads", query_width // kv, f"{PROJ} {list(proj)} / kv_channels {kv}")
        groups_width = qkv[1] - query_width  # 2 x groups x kv_channels
        if groups_width <= 0 or groups_width % (2 * kv):
            raise ModelArgsError(f"{QKV} {list(qkv)}: not heads + 2 x groups of kv_channels {kv}")
        groups = groups_width // (2 * kv)
        heads = query_width // kv
        gqa = groups != heads
        self.settle(
            "group_query_attention", gqa, f"{QKV} {list(qkv)}: {groups} key-value groups for {heads} heads"
        )
        if gqa:
            self.settle("num_query_groups", groups, f"{QKV} {list(qkv)}")

    def _mlp(self) -> None:
        t = self.tensors
        router = _shape(t, ROUTER)
        if router is not None:
            self.settle("num_experts", router[1], f"{ROUTER} {list(router)}")
            return  # expert weights live under their own keys; their width comes from the args
        if getattr(self.args, "num_experts", None):
            self.settle("num_experts", None, f"no {ROUTER}: a dense model")
        fc1, fc2 = _shape(t, FC1), _shape(t, FC2)
        if fc1 is None or fc2 is None:
            raise ModelArgsError(
                f"{FC1 if fc1 is None else FC2}: not in the checkpoint; not a Megatron-Core GPT MLP"
            )
        ffn = fc2[-1]
        self.settle("ffn_hidden_size", ffn, f"{FC2} {list(fc2)}")
        gated = fc1[1] == 2 * ffn
        self.settle("swiglu", gated, f"{FC1} {list(fc1)} against ffn_hidden_size {ffn}")

    def _positions(self) -> None:
        learned = _shape(self.tensors, POSITION_EMBEDDINGS)
        kind = getattr(self.args, "position_embedding_type", "learned_absolute")
        if learned is not None:
            self.settle("position_embedding_type", "learned_absolute", f"{POSITION_EMBEDDINGS} present")
            self.settle("max_position_embeddings", learned[0], f"{POSITION_EMBEDDINGS} {list(learned)}")
        elif kind == "learned_absolute":
            self.settle("position_embedding_type", "rope", f"no {POSITION_EMBEDDINGS}")
        if getattr(self.args, "max_position_embeddings", None) is None:
            self.out.note(
                "max_position_embeddings",
                self.require(
                    "seq_length", "neither max_position_embeddings nor the position embeddings give it"
                ),
                "Megatron-LM's default: seq_length",
            )

    def _norms_and_biases(self) -> None:
        t = self.tensors
        layer_norm = INPUT_NORM_BIAS in t or FINAL_NORM_BIAS in t
        if FINAL_NORM in t or INPUT_NORM_BIAS in t:
            self.settle(
                "normalization",
                "LayerNorm" if layer_norm else "RMSNorm",
                f"norm biases {'present' if layer_norm else 'absent'}",
            )
        linear_bias, qkv_bias = PROJ_BIAS in t, QKV_BIAS in t
        self.settle("add_bias_linear", linear_bias, f"{PROJ_BIAS} {'present' if linear_bias else 'absent'}")
        if not linear_bias:  # with biases on every linear layer, add_qkv_bias changes nothing
            self.settle("add_qkv_bias", qkv_bias, f"{QKV_BIAS} {'present' if qkv_bias else 'absent'}")
        self.settle(
            "untie_embeddings_and_output_weights",
            OUTPUT in t,
            f"{OUTPUT} {'present' if OUTPUT in t else 'absent'}",
        )

    def _precision(self) -> None:
        dtype = _dtype(self.tensors, QKV)
        half = _FLOAT16.get(dtype)
        self.settle("bf16", half == "bf16", f"{QKV} is {dtype}")
        self.settle("fp16", half == "fp16", f"{QKV} is {dtype}")
        self.args.params_dtype = dtype

    def _parallel_sizes(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            value = getattr(self.args, name, None)
            if not isinstance(value, int) or value < 1:
                self.out.note(name, 1, "missing from the args; Megatron-LM assumes 1")


def resolve(stored_args, tensors: dict) -> ResolvedArgs:
    """Megatron-LM args for the checkpoint's model: ``stored_args`` (its common state's ``args``,
    or None) settled against ``tensors`` (name -> DCP TensorStorageMetadata)."""
    return _Resolver(stored_args, tensors).run()
