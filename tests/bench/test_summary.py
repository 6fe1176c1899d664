"""The whole suite's record: one JSON with every suite, one markdown file, one PNG of the ratios."""

import json

import pytest

from tessel.bench.runner import environment
from tessel.bench.summary import plot_ratios, write_summary

ROWS = {
    "matmul": [{"case": "odd 37x53x29", "op": "matmul", "tessel/torch": 0.5}, {"case": "geomean", "tessel/torch": 0.5}],
    "attention": [{"case": "tiny", "pass": "fwd", "causal": True, "tessel/torch": 1.25}],
    "pipeline": [{"schedule": "1F1B", "p": 2, "m": 4, "bubble": 0.2}],  # no ratio column: no panel
}


def test_summary_holds_every_suite(tmp_path):
    paths = write_summary(ROWS, environment(), tmp_path)
    record = json.loads(paths[0].read_text())
    assert set(record["suites"]) == set(ROWS) and record["suites"]["attention"][0]["tessel/torch"] == 1.25
    assert record["caveat"] is None or "not performance numbers" in record["caveat"]
    table = paths[1].read_text()
    assert "odd 37x53x29" in table and "1F1B" in table


def test_ratios_are_plotted_when_matplotlib_is_present(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_ratios(ROWS, environment(), tmp_path / "ratios.png")
    assert path is not None and path.stat().st_size > 1000
    assert plot_ratios({"pipeline": ROWS["pipeline"]}, environment(), tmp_path / "none.png") is None
