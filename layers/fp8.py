"""FP8 training of linear layers: the GEMMs of forward and backward in 8-bit floats, the weights kept as they are.

:func:`fp8_linear` is ``x @ weightᵀ + bias`` whose three GEMMs run in fp8 (Transformer Engine's hybrid recipe with
current per-tensor scaling, :mod:`tessel.kernels.fp8`):

- forward: ``x`` and ``weight`` are quantised to e4m3; ``Y = X·Wᵀ`` (fp32 accumulation, written in x's dtype);
- backward: ``dY`` is quantised to e5m2; ``dX = dY·W`` and ``dW = dYᵀ·X`` multiply it with the e4m3 copies the
  forward made (each quantised once, with the transpose its backward GEMM reads), ``db = Σ dY`` in fp32.

The weights, their gradients and the optimizer stay in the model's precision (bf16 or fp32 master weights, as
ZeroAdam keeps them); only the multiplications change. What backward needs of ``x`` is its fp8 transpose, half
the bytes of a bf16 activation. The forward GEMM accumulates as the tensor cores do fastest; the backward GEMMs
sum each K block in full fp32 (``split_accumulator``), as their long reductions over tokens need.

The layers take it with ``fp8=True`` (:class:`~tessel.layers.ColumnParallelLinear`,
:class:`~tessel.layers.RowParallelLinear`: their overlapped rings and chunks with fp8 GEMMs, the sequence-parallel
activations and gradients gathered in fp8, :mod:`tessel.parallel.overlap_fp8`), a mixture of experts
(:class:`~tessel.layers.ParallelMoE`) runs its experts' grouped GEMMs in fp8 (:func:`fp8_grouped_linear`, one
scale per expert), and :func:`convert_to_fp8` turns it on across a model: tessel's layers and ``nn.Linear`` alike.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

import torch
from torch import nn

from ..kernels.fp8 import quantize_fp8
from ..kernels.grouped_matmul import _check as grouped_check
from ..kernels.grouped_matmul import _launch as grouped_launch
from ..kernels.grouped_matmul import _launch_wgrad as grouped_launch_wgrad
from ..parallel.collectives import copy_to_tp, gather_from_sequence, reduce_from_tp, reduce_scatter_to_sequence
from ..parallel.overlap_fp8 import (
    Fp8LinearFunction,
    fp8_all_gather_matmul,
    fp8_matmul_all_reduce,
    fp8_matmul_grad_all_reduce,
    fp8_matmul_reduce_scatter,
)

__all__ = ["Fp8Linear", "convert_to_fp8", "fp8_grouped_linear", "fp8_layers", "fp8_linear"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Skipped by convert_to_fp8 unless asked for: output heads, whose logits feed a softmax over the vocabulary, and
# mixture-of-experts routers (Mixtral's and Qwen-MoE's ``gate``), whose small logits pick the experts.
DEFAULT_SKIP = ("lm_head", "*.lm_head", "output", "*.output", "*.gate", "*.router", "*.shared_expert_gate")


def _check(x, weight, bias) -> None:
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fp8_linear: {name} must be a torch.Tensor, received {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"fp8_linear: {name} must be float32, float16 or bfloat16, received {t.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"fp8_linear: weight must be 2-D [out_features, in_features], received {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8_linear: x must end in weight's {weight.shape[1]} in_features, received shape {tuple(x.shape)}"
        )
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(
            f"fp8_linear: x must share weight's dtype and device ({weight.dtype}, {weight.device}), received "
            f"{x.dtype} on {x.device}"
        )
    if bias is not None and (
        not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype
    ):
        got = f"{tuple(bias.shape)} {bias.dtype}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"fp8_linear: bias must be a ({weight.shape[0]},) {weight.dtype} tensor, received {got}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weightᵀ + bias`` with its forward and backward GEMMs in fp8 (see the module's docstring).

    ``x`` ``[..., K]`` and ``weight`` ``[N, K]`` (``nn.Linear``'s layout) share one dtype (fp32, fp16 or bf16) and
    device; ``bias`` ``[N]``. Returns ``[..., N]`` in that dtype. Differentiable in all three.
    """
    _check(x, weight, bias)
    x2 = x.reshape(-1, weight.shape[1])
    return Fp8LinearFunction.apply(None, False, 1, x2, weight, bias)[0].view(*x.shape[:-1], weight.shape[0])


class _Fp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets):
        need_dx, need_dw = ctx.needs_input_grad[:2]
        xq = quantize_fp8(x, "e4m3", transpose=need_dw)
        wq = quantize_fp8(weight, "e4m3", transpose=need_dx)  # one scale per expert
        out = x.new_empty((x.shape[0], weight.shape[1]))
        grouped_launch(xq.data, wq.data.transpose(1, 2), offsets, out, scales=(xq.scale_inv, wq.scale_inv))
        ctx.save_for_backward(xq.data_t, xq.scale_inv, wq.data_t, wq.scale_inv, offsets)
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        x_t, x_scale_inv, w_t, w_scale_inv, offsets = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        gq = quantize_fp8(grad.contiguous(), "e5m2", transpose=need_dw)
        dx = dw = None
        if need_dx:  # dX_e = dY_e · W_e, W_e read along N: its fp8 transpose
            dx = grad.new_empty((grad.shape[0], ctx.weight_shape[2]))
            grouped_launch(gq.data, w_t.transpose(1, 2), offsets, dx, scales=(gq.scale_inv, w_scale_inv),
                           split_acc=True)  # fmt: skip
        if need_dw:  # dW_e = dY_eᵀ · X_e, both read along the tokens: their fp8 transposes
            dw = grad.new_empty(ctx.weight_shape, dtype=ctx.weight_dtype)
            grouped_launch_wgrad(gq.data_t.t(), x_t.t(), offsets, dw, scales=(gq.scale_inv, x_scale_inv),
                                 split_acc=True)  # fmt: skip
        return dx, dw, None


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Every expert's rows times its own weight in fp8, in one grouped launch, forward and backward: ``out
    [R, N]`` with ``out[offsets[e]:offsets[e+1]] = x[offsets[e]:offsets[e+1]] @ weight[e]ᵀ``.

    ``x`` ``[R, K]`` rows grouped by expert; ``weight`` ``[X, N, K]`` (each expert an ``nn.Linear`` layout) in x's
    dtype, each expert quantised with its own scale; ``offsets`` ``[X+1]`` as for
    :func:`~tessel.kernels.grouped_matmul`. The recipe of :func:`fp8_linear`. Differentiable in x and weight.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(
            f"fp8_grouped_linear: weight must be [X, N, K] (one nn.Linear layout per expert), received {got}"
        )
    grouped_check(x, weight.transpose(1, 2), offsets)
    return _Fp8GroupedLinear.apply(x, weight, offsets)


def column_parallel_fp8(x2, weights, biases, group, *, sequence_parallel: bool, overlap: bool | str,
                        regather: bool = False):  # fmt: skip
    """A column-parallel layer's GEMM in fp8 (or several layers' sharing their input: ``weights`` and ``biases``
    lists, one output each, the weights quantised as one): the sequence-parallel input all-gathered in fp8 (its
    gradient reduce-scattered), or the replicated input's gradient all-reduced; chunked and overlapped with
    ``overlap`` (``"peer"``: through the device-signalled transports; :mod:`tessel.parallel.overlap_fp8`). Under
    ``torch.compile``: the differentiable collectives around :func:`fp8_linear` (in the model's dtype)."""
    if not torch.compiler.is_compiling():
        if sequence_parallel:
            return fp8_all_gather_matmul(x2, weights, group, biases=biases, overlap=overlap, regather=regather)
        return fp8_matmul_grad_all_reduce(x2, weights, group, biases=biases, overlap=overlap)
    x_full = gather_from_sequence(x2, group, dim=0) if sequence_parallel else copy_to_tp(x2, group)
    if isinstance(weights, torch.Tensor):
        return fp8_linear(x_full, weights, biases)
    if all(b is None for b in biases):  # the weights as one, as eagerly: one scale
        bias = None
    else:
        bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases)])
    return list(fp8_linear(x_full, torch.cat(weights), bias).split([w.shape[0] for w in weights], dim=-1))


def row_parallel_fp8(x2, weight, bias, group, *, sequence_parallel: bool, overlap: bool | str) -> torch.Tensor:
    """A row-parallel layer's GEMM in fp8: partial outputs reduce-scattered along the sequence or all-reduced,
    chunked and overlapped with ``overlap``, the whole bias added once (its gradient summed over every rank's
    tokens). Under ``torch.compile``: :func:`fp8_linear`, then the differentiable collective."""
    if not torch.compiler.is_compiling():
        op = fp8_matmul_reduce_scatter if sequence_parallel else fp8_matmul_all_reduce
        return op(x2, weight, group, bias=bias, overlap=overlap)
    y = fp8_linear(x2, weight)
    if sequence_parallel:
        y = reduce_scatter_to_sequence(y, group, dim=0)
        return y if bias is None else y + copy_to_tp(bias, group)
    y = reduce_from_tp(y, group)
    return y if bias is None else y + bias


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run in fp8 (:func:`fp8_linear`): the same parameters, names and state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """An ``Fp8Linear`` holding ``linear``'s own parameters (not copies) and hooks: optimizers and wrappers that
        hold them keep working, and so do the hooks ``parallelize`` installs (a context-parallel mixer's
        projections)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Fp8Linear.from_linear: expected an nn.Linear, received {type(linear).__name__}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.train(linear.training)
        for hooks in _FORWARD_HOOKS:
            setattr(layer, hooks, getattr(linear, hooks))
        return layer


_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called")  # fmt: skip


def fp8_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s layers whose GEMMs run in fp8, linear layers and mixtures of experts (``""`` for
    the model itself)."""
    return [name for name, m in model.named_modules() if isinstance(m, Fp8Linear) or getattr(m, "fp8", False) is True]


def _hf_experts_weights(module: nn.Module) -> tuple[torch.Tensor, ...] | None:
    """A Hugging Face experts module's 3-d weights (its class decorated by transformers'
    ``use_experts_implementation``: the layout flags and a config), or None for any other module."""
    down = getattr(module, "down_proj", None)
    if not (isinstance(down, torch.Tensor) and down.dim() == 3 and hasattr(module, "has_gate")):
        return None
    if not hasattr(module, "config"):
        return None
    first = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    return (first, down) if isinstance(first, torch.Tensor) and first.dim() == 3 else None


def _fits(module: nn.Module) -> bool:
    """Whether every feature count is a multiple of 16: what fp8 tensor cores and their copy engine read whole
    (a mixture of experts: its experts' two projections)."""
    weights = _hf_experts_weights(module)
    if weights is None:
        weights = (module.fc, module.proj) if hasattr(module, "fc") and hasattr(module, "proj") else (module.weight,)
    return all(w.shape[-2] % 16 == 0 and w.shape[-1] % 16 == 0 for w in weights)


def _hf_experts_in_fp8(module: nn.Module) -> None:
    """A Hugging Face experts module's GEMMs in fp8: through tessel's experts implementation, which its config (the
    model's, shared by every experts module of it) then names."""
    from .hf_grouped_experts import register_hf_experts

    module.fp8 = True
    module.config._experts_implementation = register_hf_experts()


def convert_to_fp8(
    model: nn.Module,
    *,
    skip: tuple[str, ...] = DEFAULT_SKIP,
    include: Callable[[str, nn.Module], bool] | None = None,
) -> nn.Module:
    """Turn on fp8 GEMMs across ``model`` in place and return it.

    tessel's :class:`~tessel.layers.ColumnParallelLinear`, :class:`~tessel.layers.RowParallelLinear` and
    :class:`~tessel.layers.ParallelMoE` (its experts; the router stays as it is) get ``fp8 = True``; each
    ``nn.Linear`` is replaced by an :class:`Fp8Linear` holding the same parameters; a Hugging Face experts module
    (3-d weights, ``use_experts_implementation``) gets ``fp8 = True`` and its model's config names tessel's experts
    implementation (:mod:`~tessel.layers.hf_grouped_experts`; the other experts modules of the model run it too,
    in their own precision). A layer is left as it is when
    its name matches a glob of ``skip`` (the output head by default), when ``include`` (a ``(name, module) ->
    bool``) refuses it, or when its local weights' dimensions are not multiples of 16.
    """
    from .linear import ColumnParallelLinear, RowParallelLinear
    from .moe import ParallelMoE

    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_to_fp8: model must be an nn.Module, received {type(model).__name__}")
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise TypeError(f"convert_to_fp8: skip must be a tuple of name globs, received {skip!r}")
    if include is not None and not callable(include):
        raise TypeError(f"convert_to_fp8: include must be callable or None, received {type(include).__name__}")

    def wanted(name: str, module: nn.Module) -> bool:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in skip):
            return False
        return _fits(module) and (include is None or include(name, module))

    if type(model) is nn.Linear:  # the model is itself one layer
        return Fp8Linear.from_linear(model) if wanted("", model) else model
    swaps = []
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelMoE)) and wanted(name, module):
            module.fp8 = True
        elif _hf_experts_weights(module) is not None and wanted(name, module):
            _hf_experts_in_fp8(module)
        elif type(module) is nn.Linear and wanted(name, module):
            swaps.append(name)
    for name in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear.from_linear(getattr(parent, child)))
    return model
