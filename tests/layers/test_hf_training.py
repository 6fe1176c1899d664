"""A Hugging Face Llama trained with tessel under tensor, sequence, pipeline and data parallelism, and ZeRO: a few
optimizer steps follow the one-process run's loss curve.

The pieces a user combines: ``parallelize`` (tensor and sequence parallelism), ``fuse_lm_loss`` (the head's loss
without logits), ``hf_pipeline_stage`` with a schedule, and ``DDP`` / ``FSDP`` with ``ZeroAdam`` or torch's AdamW.
Four gloo ranks at most, tessel's plain-PyTorch kernels, float32; each step's global batch is the same in every
layout, so the curves agree to fp32 rounding (the tolerance is 1e-4 relative).
"""

import importlib.util

import pytest
import torch

from tests.multiprocess import REFERENCE_KERNELS, run_ranks

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers"),
    pytest.mark.multiprocess,
]

VOCAB, BATCH, SEQ, STEPS = 96, 8, 16, 3


def _llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _batch(dp_rank: int, dp: int) -> torch.Tensor:
    """This data-parallel rank's rows of the one global batch every step trains on (so the loss falls)."""
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100))
    rows = BATCH // dp
    return ids[dp_rank * rows : (dp_rank + 1) * rows]


def _targets(ids):
    return torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)


def _train(rank, world_size, tp, pp, sp, zero):
    """``STEPS`` AdamW steps of the Llama laid out as asked; the global loss of each step."""
    import torch.distributed as dist
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from tessel.layers import fuse_lm_loss, hf_pipeline_stage, parallelize
    from tessel.parallel import DDP, FSDP, ZeroAdam, init_parallel
    from tessel.parallel.pipeline import PipelineStage, Schedule1F1B

    dims = init_parallel(tp=tp, pp=pp)
    model = _llama()
    parallelize(model, dims.tp_group, sequence_parallel=sp)  # at tp=1 too: fuse_lm_loss takes a tessel head
    module = fuse_lm_loss(model) if pp == 1 else hf_pipeline_stage(model, dims.pp_rank, pp, fused_loss=True)
    if zero == 3:
        wrapper = FSDP(module, dims.dp_group, wrap={LlamaDecoderLayer})
    elif dims.dp > 1 or zero:
        wrapper = DDP(module, dims.dp_group)
    else:
        wrapper = module
    params = [p for p in module.parameters() if p.requires_grad]
    if zero:
        stage = {"stage": zero} if zero < 3 else {}
        opt = ZeroAdam(params, lr=1e-2, group=dims.dp_group, tp_group=dims.tp_group, **stage)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2)
    schedule = None
    if pp > 1:
        # through the wrapper, which gathers the head's parameters under FSDP
        schedule = Schedule1F1B(PipelineStage(wrapper, dims.pp_rank, pp, dims.pp_group), 2,
                                lambda out, target: wrapper(out, targets=target))  # fmt: skip
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        ids = _batch(dims.dp_rank, dims.dp)
        if schedule is None:
            loss = wrapper(ids, labels=ids).loss
            loss.backward()
            local = loss.detach()
        else:
            mb = []
            schedule.step(ids, target=_targets(ids), losses=mb)
            local = torch.stack(mb).mean() if module.last else torch.zeros(())
        opt.step()
        total = local.reshape(1).float()
        dist.all_reduce(total)  # the last stage's tp copies of each dp rank's mean
        losses.append(float(total) / (dims.dp * dims.tp))
    return losses


@pytest.fixture(scope="module")
def one_process():
    (losses,) = run_ranks(_train, 1, 1, 1, False, 0, timeout=240, env=REFERENCE_KERNELS)
    assert losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize(
    ("tp", "pp", "sp", "zero"),
    [(2, 2, False, 0), (2, 2, True, 0), (2, 1, True, 1), (2, 1, True, 3), (1, 1, False, 2), (1, 2, False, 3)],
    ids=["tp2-pp2", "tp2-sp-pp2", "tp2-sp-dp2-zero1", "tp2-sp-dp2-fsdp", "dp4-zero2", "pp2-dp2-fsdp"],
)
def test_layouts_follow_the_one_process_curve(one_process, tp, pp, sp, zero):
    world = 4
    results = run_ranks(_train, world, tp, pp, sp, zero, timeout=300, env=REFERENCE_KERNELS)
    for losses in results:
        assert losses == pytest.approx(one_process, rel=1e-4)
