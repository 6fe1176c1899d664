"""Key and value heads fewer than the tensor-parallel ranks, replicated over them (:mod:`tessel.layers.hf_kv_replicas`):
Hugging Face models (tiny, random init) dense against parallelized on four gloo ranks, as tests/layers/test_hf.py
checks them (logits and every gradient, fp32, 1e-4 relative)."""

import copy

import pytest
import torch

from tests.layers.test_hf import REFERENCE_KERNELS, _check_against_dense, _model, needs_hf
from tests.multiprocess import run_ranks


def _replicas(rank, world_size):
    from tessel.layers.linear import ColumnParallelLinear
    from tessel.layers.parallelize import parallelize
    from tests.layers.test_hf_plans import qk_norm_model

    # each kv head on the ranks whose query heads read it (2 or 4 of them); Qwen3's per-head k norm on each rank's kv
    # head, its gradient summed
    for family, kv_heads in (("llama", 2), ("mistral", 2), ("qwen2", 1), ("qwen3", 2)):
        for sp in (False, True):
            dense = _model(family, kv_heads=kv_heads)
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp, overlap=sp or "auto")
            attention, whole = par.model.layers[0].self_attn, dense.model.layers[0].self_attn
            assert isinstance(attention.k_proj, ColumnParallelLinear) and attention.k_proj.max_chunks == (kv_heads,)
            head = rank // (world_size // kv_heads)  # a copy of the kv head this rank's query heads read
            assert torch.equal(attention.v_proj.weight, whole.v_proj.weight[16 * head : 16 * head + 16])
            assert attention.k_proj.shared_input is attention.q_proj.shared_input is not None or sp
            assert attention.q_proj.weight.shape == (16, 64) and attention.num_key_value_groups == 1
            _check_against_dense(dense, par, f"{family} {kv_heads} kv heads sp={sp}")
    # fused projections: Phi-3's qkv_proj with 2 kv heads, a multi-query GPT-BigCode's c_attn (StarCoder's) with one;
    # one ColumnParallelLinear each, holding this rank's query heads and a copy of its kv head
    from tests.layers.test_hf_classic import classic_model
    from tests.layers.test_hf_plans import phi3_model

    for name, make, kv_heads, path in (("phi3", lambda: phi3_model(kv_heads=2), 2, "model.layers.0.self_attn.qkv_proj"),
                                       ("gpt_bigcode", lambda: classic_model("gpt_bigcode_mqa"), 1,
                                        "transformer.h.0.attn.c_attn")):  # fmt: skip
        for sp in (False, True):
            dense = make()
            par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp, overlap=sp or "auto")
            fused, whole = par.get_submodule(path), dense.get_submodule(path).weight
            head = rank // (world_size // kv_heads)
            q, k, v = whole.split([64, 16 * kv_heads, 16 * kv_heads])
            assert fused.chunks == (world_size, kv_heads, kv_heads)
            assert fused.weight.tp_max_chunks == (None, kv_heads, kv_heads)
            mine = torch.cat(
                [q[16 * rank : 16 * rank + 16], k[16 * head : 16 * head + 16], v[16 * head : 16 * head + 16]]
            )
            assert torch.equal(fused.weight, mine), name
            _check_against_dense(dense, par, f"{name} {kv_heads} kv heads sp={sp}")
    # OLMo 2's k norm spans every kv head's features: its 2 kv heads are not replicated, and the model is as it was
    model = qk_norm_model("olmo2", kv_heads=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for sp in (False, True):
        with pytest.raises(ValueError, match=r"k_proj: 2 heads \(width 32, head_dim 16\) do not split over 4"):
            parallelize(model, None, sequence_parallel=sp)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_kv_heads_fewer_than_the_ranks_are_replicated_over_them():
    assert run_ranks(_replicas, 4, timeout=300, env=REFERENCE_KERNELS) == ["ok"] * 4


def _loaded(rank, world_size, root):
    import os

    import torch.distributed as dist

    from tessel.layers import load_pretrained, parallelize
    from tests.layers.test_hf_classic import classic_model
    from tests.layers.test_hf_load import _assert_same_tensors, _on_meta
    from tests.layers.test_hf_plans import phi3_model

    # separate k_proj/v_proj (Llama); fused qkv_proj (Phi-3) and c_attn (a multi-query GPT-BigCode) with copies
    models = {"llama": _model("llama", kv_heads=1), "phi3": phi3_model(kv_heads=1),
              "gpt_bigcode": classic_model("gpt_bigcode_mqa")}  # fmt: skip
    for name, dense in models.items():
        path = os.path.join(root, name)
        if rank == 0:
            dense.save_pretrained(path)
        dist.barrier()
        for sp in (False, True):
            model = load_pretrained(parallelize(_on_meta(dense), None, sequence_parallel=sp), path)
            _assert_same_tensors(model, parallelize(copy.deepcopy(dense), None, sequence_parallel=sp), f"sp={sp}")
            _check_against_dense(copy.deepcopy(dense), model.eval(), f"{name} loaded sp={sp}")
    return "ok"


@pytest.mark.multiprocess
@needs_hf
def test_replicated_kv_heads_load_whole_on_the_meta_device(tmp_path):
    """One kv head over two ranks, split on the meta device and loaded: k_proj and v_proj read whole on each rank, a
    fused projection's copy of the kv head read into each rank's weight; equal to the split dense model, with and
    without sequence parallelism."""
    assert run_ranks(_loaded, 2, str(tmp_path), timeout=300, env=REFERENCE_KERNELS) == ["ok"] * 2
