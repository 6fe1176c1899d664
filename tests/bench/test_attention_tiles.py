"""The backward's tile sweep: pinning a candidate, the CPU rows, on a GPU a row per candidate with the pick marked."""

import pytest
import torch
import triton

from tessel.bench.__main__ import ON_REQUEST, SUITES
from tessel.bench.attention_tiles import COLUMNS, SWEPT, pinned, run_attention_tiles_suite
from tessel.kernels import attention_kernels
from tessel.kernels.attention_kernels import tile_name


def test_a_pinned_autotuner_runs_its_one_candidate_and_gets_its_candidates_back():
    tuned = attention_kernels._TUNED["dkdv"]
    configs, original = tuned.configs, tuned.cache
    tuned.cache = cache = {("key",): configs[0]}
    try:
        with pinned(tuned, configs[-1]):
            assert tuned.configs == [configs[-1]] and tuned.cache == {}  # one candidate: Triton times nothing
        assert tuned.configs is configs and tuned.cache is cache
        with pytest.raises(RuntimeError), pinned(tuned, configs[1]):
            raise RuntimeError("a launch failed")
        assert tuned.configs is configs and tuned.cache is cache
        with pytest.raises(TypeError, match=r"pinned: tuned must be a triton\.autotune autotuner, received dict"):
            pinned({}, configs[0]).__enter__()
        stranger = triton.Config({"BLOCK_M": 8, "BLOCK_N": 8}, num_warps=1, num_stages=1)
        with pytest.raises(ValueError, match="pinned: config must be one of the autotuner's candidates"):
            pinned(tuned, stranger).__enter__()
        assert tuned.configs is configs and tuned.cache is cache  # nothing changed
    finally:
        tuned.cache = original


def test_tiles_are_named_by_rows_columns_warps_and_stages():
    assert tile_name(triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=3)) == "64x128 w8 s3"


def test_the_sweep_runs_only_when_named(monkeypatch, tmp_path):
    import tessel.bench.__main__ as cli

    ran = []
    for name in SUITES:
        monkeypatch.setitem(SUITES, name, lambda dtype, quick, name=name, **_: ran.append(name) or [{"case": name}])
    monkeypatch.setattr(cli, "report", lambda *args, **kwargs: None)
    monkeypatch.setattr(cli, "write_summary", lambda *args, **kwargs: [])
    assert cli.main(["--out", str(tmp_path)]) == 0
    assert ran == [name for name in SUITES if name not in ON_REQUEST] and "attention-tiles" in ON_REQUEST
    ran.clear()
    assert cli.main(["attention-tiles", "--out", str(tmp_path)]) == 0
    assert ran == ["attention-tiles"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rows")
def test_cpu_rows_time_each_backward_through_the_interpreter():
    rows = run_attention_tiles_suite(quick=True)
    assert [r["kernel"] for r in rows] == list(SWEPT)
    for row in rows:
        assert tuple(row) == COLUMNS
        assert row["tile"] == "autotuned: interpreter" and row["picked"] and row["causal"]
        assert row["tessel_ms"] > 0 and row["tessel/torch"] == pytest.approx(row["torch_ms"] / row["tessel_ms"])


@pytest.mark.gpu
def test_gpu_rows_time_every_candidate_and_mark_the_pick(monkeypatch):
    import tessel.bench.attention_tiles as tiles

    # a small shape: the pinned tiles reuse the programs the autotuner compiled, so the cost is one tuning each
    monkeypatch.setattr(tiles, "SHAPES_GPU", (tiles.AttentionShape("small", 1, 4, 256, 64),))
    rows = run_attention_tiles_suite(quick=True)
    assert {r["case"] for r in rows} == {"small"}
    for kernel, (_, tuned_name) in SWEPT.items():
        tuned = attention_kernels._TUNED[tuned_name]
        mine = [r for r in rows if r["kernel"] == kernel]
        autotuned = [r for r in mine if r["tile"].startswith("autotuned: ")]
        tiles = [r for r in mine if r not in autotuned]
        assert len(autotuned) == 1 and 0 < len(tiles) <= len(tuned.configs), kernel
        assert {r["tile"] for r in tiles} <= {tile_name(c) for c in tuned.configs}
        picked = [r["tile"] for r in tiles if r["picked"]]
        assert picked == [autotuned[0]["tile"].removeprefix("autotuned: ")], (kernel, picked)
        assert len(tuned.configs) > 1  # the candidates are back after the sweep
