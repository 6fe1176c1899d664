"""``pytest bench --benchmark-only``: the pipeline suite's cases under pytest-benchmark.

Times building, validating and simulating each schedule's program for each layout of
``python -m tessel.bench pipeline`` (a CPU-only computation on any machine), with the simulated bubble
and its formula attached as extra info. pytest imports this file as ``bench.bench_pipeline``, outside
the installed package, hence the absolute ``tessel.bench`` imports.
"""

import pytest

from tessel.bench.pipeline import SCHEDULES, pipeline_cases
from tessel.parallel.pipeline.simulate import simulate


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize(("p", "m"), pipeline_cases(), ids=lambda x: str(x))
def test_simulate(benchmark, name, p, m):
    build, v, formula = SCHEDULES[name]
    sim = benchmark.pedantic(lambda: simulate(build(p, m)), rounds=3, warmup_rounds=1, iterations=1)
    assert sim.bubble_fraction == pytest.approx(formula(p, m), abs=1e-9)  # a wrong schedule's timing means nothing
    benchmark.group = f"pipeline p={p} m={m}"
    benchmark.extra_info.update(p=p, m=m, v=v, bubble=sim.bubble_fraction, formula=formula(p, m),
                                peak_activations=max(sim.peak_activations))  # fmt: skip
