"""The pipeline benchmark suite on the CPU: every case present, finite, equal to its formula; the PNG written."""

import math

import pytest

from tessel.bench.matmul import BenchmarkError
from tessel.bench.pipeline import COLUMNS, SCHEDULES, pipeline_cases, run_pipeline_suite


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    return run_pipeline_suite(None, quick=True, out_dir=out), out


def test_rows_cover_every_schedule_and_layout(quick):
    rows, _ = quick
    assert all(tuple(row) == COLUMNS for row in rows)
    assert sorted((r["schedule"], r["p"], r["m"]) for r in rows) == sorted(
        (name, p, m) for p, m in pipeline_cases(quick=True) for name in SCHEDULES
    )
    for row in rows:
        numbers = [row[c] for c in COLUMNS[1:]]
        assert all(isinstance(x, int | float) and math.isfinite(x) for x in numbers), row
        # The suite checked the simulation against the formula before returning the row.
        assert row["bubble"] == pytest.approx(row["formula"], abs=1e-9)


def test_rows_show_the_expected_orderings(quick):
    rows, _ = quick
    by = {(r["schedule"], r["p"], r["m"]): r for r in rows}
    for p, m in pipeline_cases(quick=True):
        assert by["GPipe", p, m]["peak_activations"] == m and by["1F1B", p, m]["peak_activations"] == p
        assert by["ZB-H1", p, m]["bubble"] < by["Interleaved1F1B(v=2)", p, m]["bubble"] < by["1F1B", p, m]["bubble"]


def test_writes_the_schedules_png(quick, capsys):
    _, out = quick
    (png,) = out.glob("*-pipeline-schedules-p4-m8.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_wrong_simulation_stops_the_suite(monkeypatch, tmp_path):
    import tessel.bench.pipeline as suite

    build, v, _ = suite.SCHEDULES["1F1B"]
    monkeypatch.setitem(suite.SCHEDULES, "1F1B", (build, v, lambda p, m: 0.5))
    with pytest.raises(BenchmarkError, match=r"1F1B with p=2, m=2: simulated bubble 0.333333 differs"):
        run_pipeline_suite(None, quick=True, out_dir=tmp_path)
