"""Model providers as a job would name them in ``drill.model_provider`` (``module:function``,
called like Megatron-LM's ``gpt_builder``: args, pre_process, post_process)."""

import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig


def gpt_from_args(args, pre_process=True, post_process=True, **_):
    """A job's own builder: a Megatron-Core GPT assembled from its args without ckptops' help."""
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        activation_func=F.gelu,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        bf16=args.bf16,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=True,
    )


def broken(args, pre_process=True, post_process=True, **_):
    """A provider that fails inside the load, as a job's own code can."""
    raise RuntimeError(f"no layer type for {args.num_layers} layers in this provider")
