import copy
import json
import os
import traceback

from tests.layers.test_hf import REFERENCE_KERNELS, _check_against_dense
from tests.layers.test_hf_families import family_model
from tests.multiprocess import run_ranks


def _r(rank, world_size, kind, sp, extra):
    from tessel.layers.parallelize import parallelize
    try:
        dense = family_model(kind, **extra)
        par = parallelize(copy.deepcopy(dense), None, sequence_parallel=sp)
        _check_against_dense(dense, par, f"{kind} sp={sp}")
        return "ok"
    except Exception:
        return traceback.format_exc()[-1500:]


def test_probe():
    for kind in os.environ["KIND"].split(","):
        for sp in (False, True):
            extra = json.loads(os.environ.get("EXTRA", "{}"))
            print("\nRESULT", kind, sp, run_ranks(_r, 2, kind, sp, extra, timeout=90, env=REFERENCE_KERNELS)[0][-700:])
