"""RMSNorm and LayerNorm modules on the fused kernels, for replicated and sequence-parallel activations.

Legend: ``B`` batch, ``S`` sequence, ``H`` hidden, ``t`` tensor-parallel size.

Without sequence parallelism the activation ``[B, S, H]`` is replicated on every TP rank, so each rank
computes the complete weight gradient itself and nothing is communicated. With ``sequence_parallel``
each rank normalises only its ``[B, S/t, H]`` shard and its weight gradient covers only those tokens;
the weight (and bias) then enter the kernel through ``copy_to_tp`` (identity forward, all-reduce
backward), so after ``backward()`` every rank's ``.grad`` is the gradient over the whole sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.norm import layer_norm, rms_norm, rms_norm_reference
from ..parallel.collectives import copy_to_tp, sum_over_ranks
from ..parallel.comm import group_rank, group_size
from .meta import probe_copy

__all__ = ["LayerNorm", "RMSNorm", "SplitRMSNorm", "sequence_parallel_norm"]


def _shared(param: torch.Tensor | None, layer: nn.Module) -> torch.Tensor | None:
    """The parameter as the kernel sees it: through ``copy_to_tp`` when its gradient is partial per rank."""
    if param is None or not layer.sequence_parallel or layer.tp_size == 1:
        return param
    return copy_to_tp(param, layer.tp_group)


def _check_dim(name: str, dim) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"{name}: dim must be a positive int, received {dim!r}")


def _single_dim(name: str, module: nn.Module, shape) -> int:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if len(shape) != 1:
        raise ValueError(f"{name}.from_module: only the last dimension can be normalised, received shape {shape}")
    if getattr(module, "weight", None) is None:
        raise ValueError(f"{name}.from_module: the module has no weight (elementwise_affine=False); tessel's norms "
                         "always have one")  # fmt: skip
    return shape[0]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x²) + eps) · weight`` over the last dimension, fused forward and backward.

    ``eps=None`` takes ``torch.finfo(x.dtype).eps`` at each call, as ``torch.nn.RMSNorm`` does. The
    weight may be float32 while activations are fp16/bf16 (the output keeps the activation's dtype).
    """

    def __init__(self, dim, eps=1e-6, *, tp_group=None, sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        _check_dim(type(self).__name__, dim)
        self.dim, self.eps = dim, eps
        self.tp_group, self.tp_size, self.sequence_parallel = tp_group, group_size(tp_group), sequence_parallel
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps
        if eps is None and isinstance(x, torch.Tensor) and x.is_floating_point():
            eps = torch.finfo(x.dtype).eps
        return rms_norm(x, _shared(self.weight, self), eps)

    @classmethod
    def from_module(cls, norm: nn.Module, *, tp_group=None, sequence_parallel=False) -> RMSNorm:
        """From ``torch.nn.RMSNorm``, a tessel ``RMSNorm`` (e.g. to turn on sequence parallelism), or any RMS
        norm with ``.weight`` and ``.variance_epsilon`` / ``.eps`` (Hugging Face's LlamaRMSNorm, Qwen2RMSNorm, ...).

        Modules of other classes are probed once on a small random input and refused when
        they do not compute ``x·rsqrt(mean(x²) + eps)·weight`` (e.g. Gemma's ``(1 + weight)`` form).
        """
        name = cls.__name__
        if isinstance(norm, RMSNorm):
            dim, eps = norm.dim, norm.eps
        elif isinstance(norm, nn.RMSNorm):
            dim, eps = _single_dim(name, norm, norm.normalized_shape), norm.eps
        else:
            w, eps = _foreign_rms_norm(name, norm)
            dim = w.shape[0]
        w = norm.weight
        layer = cls(dim, eps, tp_group=tp_group, sequence_parallel=sequence_parallel, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            layer.weight.copy_(w)
        return layer

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"


def _foreign_rms_norm(name: str, norm: nn.Module) -> tuple[torch.Tensor, float]:
    """The weight and eps of an RMS norm of another library, probed: it must compute ``x·rsqrt(mean(x²) + eps)·w``."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or eps is None:
        raise TypeError(f"{name}.from_module: expected torch.nn.RMSNorm or a module with a 1-D .weight and "
                        f".variance_epsilon or .eps, received {type(norm).__name__}")  # fmt: skip
    _check_computes_rms_norm(name, probe_copy(norm), eps)  # on the meta device: a copy with random values
    return w, eps


def _check_computes_rms_norm(name: str, norm: nn.Module, eps: float) -> None:
    weight = norm.weight
    probe = torch.randn(2, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    with torch.no_grad():
        got = norm(probe).float()
        want = rms_norm_reference(probe, weight, eps).float()
    # Hugging Face rounds x̂ to the activation dtype before the weight multiplies it: two roundings of
    # fp16/bf16 (half an ulp each, 2⁻¹¹ / 2⁻⁸ relative) against our one; fp32 differs only in operation order.
    tol = 1e-5 if weight.dtype == torch.float32 else 2 * torch.finfo(weight.dtype).eps
    if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()):
        raise ValueError(f"{name}.from_module: {type(norm).__name__} does not compute x·rsqrt(mean(x²) + eps)·weight "
                         "on a probe input, so its weight cannot be copied as is")  # fmt: skip


def _check_computes_layer_norm(name: str, norm: nn.LayerNorm) -> None:
    norm = probe_copy(norm)  # on the meta device: a copy with random values
    w = norm.weight
    probe = torch.randn(2, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    with torch.no_grad():
        got = norm(probe).float()
        want = torch.nn.functional.layer_norm(probe.float(), (w.shape[0],), w.float(), _float(norm.bias), norm.eps)
    tol = 1e-5 if w.dtype == torch.float32 else 2 * torch.finfo(w.dtype).eps
    if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()):
        raise ValueError(f"{name}.from_module: {type(norm).__name__} overrides nn.LayerNorm.forward and does not "
                         "compute (x - mean)·rsqrt(var + eps)·weight + bias on a probe input")  # fmt: skip


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


class LayerNorm(nn.Module):
    """``y = (x − mean) / sqrt(var + eps) · weight + bias`` over the last dimension, fused forward and backward.

    Names and initialisation as ``torch.nn.LayerNorm``: ``.weight`` ones, ``.bias`` zeros (or None with
    ``bias=False``).
    """

    def __init__(self, dim, eps=1e-5, bias=True, *, tp_group=None, sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        _check_dim(type(self).__name__, dim)
        self.dim, self.eps = dim, eps
        self.tp_group, self.tp_size, self.sequence_parallel = tp_group, group_size(tp_group), sequence_parallel
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, _shared(self.weight, self), _shared(self.bias, self), self.eps)

    @classmethod
    def from_module(cls, norm: nn.Module, *, tp_group=None, sequence_parallel=False) -> LayerNorm:
        """From ``torch.nn.LayerNorm`` (normalising the last dimension, with a weight) or a tessel ``LayerNorm``."""
        if isinstance(norm, LayerNorm):
            dim = norm.dim
        elif isinstance(norm, nn.LayerNorm):
            dim = _single_dim(cls.__name__, norm, norm.normalized_shape)
            if type(norm).forward is not nn.LayerNorm.forward:  # a subclass of its own (Nemotron's 1 + weight)
                _check_computes_layer_norm(cls.__name__, norm)
        else:
            raise TypeError(f"{cls.__name__}.from_module: expected torch.nn.LayerNorm or a tessel LayerNorm, received "
                            f"{type(norm).__name__}")  # fmt: skip
        w = norm.weight
        layer = cls(dim, norm.eps, norm.bias is not None, tp_group=tp_group, sequence_parallel=sequence_parallel,
                    device=w.device, dtype=w.dtype)  # fmt: skip
        with torch.no_grad():
            layer.weight.copy_(w)
            if norm.bias is not None:
                layer.bias.copy_(norm.bias)
        return layer

    def extra_repr(self) -> str:
        return (f"{self.dim}, eps={self.eps}, bias={self.bias is not None}, tp={self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}")  # fmt: skip


class SplitRMSNorm(nn.Module):
    """An RMS norm whose features are split over the tensor-parallel group: rank ``r`` of ``t`` holds features
    ``r·dim/t …`` of its input and of ``weight``, and ``y = x·rsqrt(mean(x²) + eps)·weight`` with the mean over
    all ``dim`` features.

    Hugging Face attention whose query and key norms span every head (OLMo 2 and 3, OLMoE, FlexOlmo, MiniMax-M2)
    keeps them after its projections are split by heads (``parallelize``'s style ``colwise_norm``): each rank's
    projection gives it its heads' features, whose squares it sums in fp32; the sums are all-reduced
    (:func:`~tessel.parallel.collectives.sum_over_ranks`, whose backward all-reduces too: every rank's output
    depends on every rank's features), one fp32 per row in each direction. The output is computed in fp32 and
    rounded once to ``x``'s dtype. ``.weight`` is this rank's slice, tagged ``tensor_parallel`` (``tp_dim = 0``),
    and its gradient is complete on each rank.
    """

    def __init__(self, dim, eps=1e-6, *, tp_group=None, device=None, dtype=None):
        super().__init__()
        name = type(self).__name__
        _check_dim(name, dim)
        t = group_size(tp_group)
        if dim % t:
            raise ValueError(f"{name}: dim={dim} is not divisible by the tensor-parallel size {t}")
        self.dim, self.eps, self.tp_group, self.tp_size = dim, eps, tp_group, t
        self.weight = nn.Parameter(torch.ones(dim // t, device=device, dtype=dtype))
        self.weight.tensor_parallel, self.weight.tp_dim, self.weight.tp_parts = True, 0, (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.dim // self.tp_size
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1 or x.shape[-1] != local:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{type(self).__name__}: expected a floating tensor [..., {local}] (features {self.dim} "
                             f"over {self.tp_size} ranks), received {got}")  # fmt: skip
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        xf = x.float()
        squares = xf.square().sum(-1, keepdim=True)
        if self.tp_size > 1:
            squares = sum_over_ranks(squares, self.tp_group)
        return (xf * torch.rsqrt(squares / self.dim + eps) * self.weight.float()).to(x.dtype)

    @classmethod
    def from_module(cls, norm: nn.Module, *, tp_group=None) -> SplitRMSNorm:
        """This rank's share of a whole RMS norm (``torch.nn.RMSNorm``, a tessel ``RMSNorm``, or one of another
        library's, probed as :meth:`RMSNorm.from_module` probes it)."""
        name = cls.__name__
        if isinstance(norm, (RMSNorm, nn.RMSNorm)):
            if isinstance(norm, nn.RMSNorm):
                _single_dim(name, norm, norm.normalized_shape)
            w, eps = norm.weight, norm.eps
        else:
            w, eps = _foreign_rms_norm(name, norm)
        t = group_size(tp_group)
        layer = cls(w.shape[0], eps, tp_group=tp_group, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            layer.weight.copy_(w.detach().chunk(t)[group_rank(tp_group)])
        return layer

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, tp={self.tp_size}"


def sequence_parallel_norm(norm: nn.Module, tp_group) -> nn.Module | None:
    """tessel's norm over sequence shards in place of ``norm``, or None when tessel's kernels do not compute what
    ``norm`` does (it then keeps its forward, and its gradients are reduced over the group)."""
    if isinstance(norm, (RMSNorm, LayerNorm)):
        kw = {"bias": norm.bias is not None} if isinstance(norm, LayerNorm) else {}
        w = norm.weight
        layer = type(norm)(norm.dim, norm.eps, tp_group=tp_group, sequence_parallel=True, device=w.device,
                           dtype=w.dtype, **kw)  # fmt: skip
        layer.load_state_dict(norm.state_dict())
        return layer
    cls = LayerNorm if isinstance(norm, nn.LayerNorm) else RMSNorm
    try:  # RMSNorm.from_module probes foreign norms and refuses those it does not reproduce (Gemma's 1 + w)
        return cls.from_module(norm, tp_group=tp_group, sequence_parallel=True)
    except (TypeError, ValueError):
        return None
