"""Triton kernels with host launchers and a plain-PyTorch reference for each."""

if __name__ == "kernels":
    # This folder found on sys.path as a top-level package "kernels" (the repository's root on sys.path, and
    # transformers importing any "kernels" it finds while it looks for the Hugging Face package of that name):
    # stay empty, so that tessel's kernels, and the custom operators of .library, exist once, as tessel.kernels.
    __all__ = []
else:
    from . import library  # noqa: F401  registers the custom operators torch.compile traces
    from .adam import adam_step, adam_step_reference, grad_stats, grad_stats_reference
    from .attention import HEAD_DIMS, flash_attention, flash_attention_backward, flash_attention_reference
    from .fp8 import FP8_FORMATS, Fp8Tensor, fp8_matmul, fp8_matmul_reference, quantize_fp8, quantize_fp8_reference
    from .grouped_matmul import (
        grouped_matmul,
        grouped_matmul_reference,
        grouped_weight_grad,
        grouped_weight_grad_reference,
    )
    from .matmul import ACTIVATIONS, matmul, matmul_reference
    from .norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference

    __all__ = [
        "ACTIVATIONS",
        "FP8_FORMATS",
        "HEAD_DIMS",
        "Fp8Tensor",
        "adam_step",
        "adam_step_reference",
        "flash_attention",
        "flash_attention_backward",
        "flash_attention_reference",
        "fp8_matmul",
        "fp8_matmul_reference",
        "grad_stats",
        "grad_stats_reference",
        "grouped_matmul",
        "grouped_matmul_reference",
        "grouped_weight_grad",
        "grouped_weight_grad_reference",
        "layer_norm",
        "layer_norm_reference",
        "matmul",
        "matmul_reference",
        "quantize_fp8",
        "quantize_fp8_reference",
        "rms_norm",
        "rms_norm_reference",
    ]
