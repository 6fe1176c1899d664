"""``python -m tessel.bench``: the CPU run end to end, its result files, and its argument errors."""

import json
import os
import subprocess
import sys

import pytest

from tessel.bench.__main__ import main
from tessel.bench.matmul import COLUMNS, OPS
from tessel.bench.shapes import matmul_shapes

# Hidden GPUs make the run take the CPU path (interpreter, CPU shape table) on any machine.
CPU_ENV = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def _bench(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "tessel.bench", *args], cwd=cwd, env=CPU_ENV, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    return _bench("matmul", "--quick", "--out", str(out), cwd=out), out


@pytest.mark.slow
def test_quick_run_succeeds_and_warns_about_the_interpreter(quick_run):
    proc, _ = quick_run
    assert proc.returncode == 0, proc.stderr
    caveat_lines = [line for line in proc.stdout.splitlines() if "not performance numbers" in line]
    assert len(caveat_lines) == 2, proc.stdout  # before and after the table
    assert "interpreter" in caveat_lines[0]


@pytest.mark.slow
def test_quick_run_writes_json_with_every_case_and_a_geomean(quick_run):
    _, out = quick_run
    (path,) = out.glob("*-cpu-interpreter-matmul.json")
    record = json.loads(path.read_text())
    assert record["suite"] == "matmul"
    assert record["interpreter"] is True and "not performance numbers" in record["caveat"]
    assert {"date", "device", "driver", "cuda", "torch", "triton"} <= record.keys()
    rows = record["rows"]
    assert all(tuple(row) == COLUMNS for row in rows)
    shapes = matmul_shapes(cuda=False, quick=True)
    measured = [row for row in rows if row["case"] != "geomean"]
    assert sorted((r["case"], r["op"]) for r in measured) == sorted((s.label, op) for s in shapes for op in OPS)
    for row in measured:
        assert row["dtype"] == "float32" and row["tessel_of_peak"] is None
        assert row["max_rel_err"] < 1e-4 and row["tessel_ms"] > 0 and row["torch_ms"] > 0
        assert row["program"] == "32x32x32 tiles (interpreter)"  # the program that ran, named
    geomeans = [row for row in rows if row["case"] == "geomean"]
    assert [row["op"] for row in geomeans] == list(OPS)
    assert all(row["tessel/torch"] > 0 for row in geomeans)


@pytest.mark.slow
def test_quick_run_writes_markdown_with_versions(quick_run):
    _, out = quick_run
    (path,) = out.glob("*-cpu-interpreter-matmul.md")
    text = path.read_text()
    for field in ("- date:", "- GPU:", "- driver:", "- torch:", "- triton:", "not performance numbers", "| geomean |"):
        assert field in text


@pytest.mark.parametrize(
    ("args", "expected"),
    [(["no-such-suite"], "no-such-suite"), (["--dtype", "int8"], "int8"), (["--frobnicate"], "--frobnicate")],
)
def test_bad_argument_ends_the_run_with_one_line(tmp_path, capsys, args, expected):
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and expected in lines[0], err
    assert out == "" and not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_the_command_exits_nonzero_with_one_line(tmp_path):
    """The same through ``python -m tessel.bench``."""
    proc = _bench("no-such-suite", "--out", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m tessel.bench: error: unknown suite"), proc.stderr
    assert not list(tmp_path.iterdir())
