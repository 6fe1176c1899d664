"""nn.Modules built from tessel's kernels and parallel ops, the reference GPT, and model swap-in."""

from .attention import ParallelAttention
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .fp8 import Fp8Linear, convert_to_fp8, fp8_grouped_linear, fp8_layers, fp8_linear
from .gpt import GPT, GPTConfig, TransformerBlock
from .hf import register_hf_attention
from .hf_balance import track_expert_loads
from .hf_grouped_experts import register_hf_experts
from .hf_load import load_pretrained
from .hf_loss import fuse_lm_loss
from .hf_pipeline import HFPipelineStage, hf_pipeline_stage
from .linear import ColumnParallelLinear, RowParallelLinear
from .linear_cross_entropy import linear_cross_entropy
from .mlp import ParallelMLP
from .moe import ParallelMoE, update_expert_biases
from .norm import LayerNorm, RMSNorm
from .parallelize import parallelize
from .shared_input import SharedInput

__all__ = [
    "GPT",
    "ColumnParallelLinear",
    "Fp8Linear",
    "GPTConfig",
    "HFPipelineStage",
    "LayerNorm",
    "ParallelAttention",
    "ParallelMLP",
    "ParallelMoE",
    "RMSNorm",
    "RowParallelLinear",
    "SharedInput",
    "TransformerBlock",
    "VocabParallelEmbedding",
    "convert_to_fp8",
    "fp8_grouped_linear",
    "fp8_layers",
    "fp8_linear",
    "fuse_lm_loss",
    "hf_pipeline_stage",
    "linear_cross_entropy",
    "load_pretrained",
    "parallelize",
    "register_hf_attention",
    "register_hf_experts",
    "track_expert_loads",
    "update_expert_biases",
    "vocab_parallel_cross_entropy",
]
