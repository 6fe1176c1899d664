"""``python -m tessel.bench [SUITE ...] [--out DIR] [--dtype {bf16,fp16,fp32}] [--quick]``

Runs the named benchmark suites (when none is named, all but the diagnostics in :data:`ON_REQUEST`), prints
each one's table and writes ``<out>/<date>-<device>-<suite>.json`` and ``.md``; with several suites also
``<out>/<date>-<device>.json``, ``.md`` and a PNG of tessel's ratios to the baselines (:mod:`.summary`). A suite
is a function ``(dtype, quick) -> rows`` registered in :data:`SUITES`.
"""

import argparse
import os
import sys

import torch

# Without a GPU the kernels run through Triton's interpreter. Triton reads the flag when a kernel is
# defined, so it is set before anything below imports triton or tessel.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .adam import run_adam_suite
from .attention import run_attention_suite
from .attention_tiles import run_attention_tiles_suite
from .decode import run_decode_suite
from .experts import run_experts_suite
from .fp8 import run_fp8_suite
from .loss import run_loss_suite
from .matmul import BenchmarkError, run_matmul_suite
from .overlap import run_overlap_suite
from .overlap_gated import run_overlap_gated_suite
from .pipeline import run_pipeline_suite
from .runner import environment, report
from .summary import write_summary
from .window import run_window_suite

__all__ = ["ON_REQUEST", "SUITES", "main"]

SUITES = {
    "matmul": run_matmul_suite,
    "fp8": run_fp8_suite,
    "attention": run_attention_suite,
    "window": run_window_suite,
    "decode": run_decode_suite,
    "experts": run_experts_suite,
    "adam": run_adam_suite,
    "loss": run_loss_suite,
    "overlap": run_overlap_suite,
    "pipeline": run_pipeline_suite,
    "attention-tiles": run_attention_tiles_suite,
    "overlap-gated": run_overlap_gated_suite,
}
# Diagnostics that run only when named: the whole suite (no SUITE given) leaves them out.
ON_REQUEST = {"attention-tiles", "overlap-gated"}
# Suites whose figures are exact counts, the same on every machine (not timings); on a CPU the overlap
# suite reports bytes and schedules only.
HARDWARE_INDEPENDENT = {"pipeline"} | (set() if torch.cuda.is_available() else {"overlap", "overlap-gated"})
# Suites that write files of their own (plots) next to the tables.
WRITES_FILES = {"pipeline"}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument in one line (argparse's default adds the whole usage text)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m tessel.bench",
        description="Run tessel's benchmark suites (all when none is named); print and write the results.",
    )
    every = f"all but {', '.join(sorted(ON_REQUEST))}"
    parser.add_argument(
        "suites", nargs="*", metavar="SUITE", help=f"suites to run: {', '.join(SUITES)} (default: {every})"
    )
    parser.add_argument("--out", default="bench/results", help="directory for the result files (default: %(default)s)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default=None, help="input dtype (default: bf16 on a GPU, fp32 on a CPU)"
    )
    parser.add_argument("--quick", action="store_true", help="core shapes only and fewer repetitions")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the suites, print and write their results; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    unknown = [name for name in args.suites if name not in SUITES]
    if unknown:
        parser.error(f"unknown suite {unknown[0]!r}; choose from {', '.join(SUITES)}")
    dtype = DTYPES[args.dtype] if args.dtype else None
    env = environment()
    results = {}
    for name in args.suites or [name for name in SUITES if name not in ON_REQUEST]:
        kwargs = {"out_dir": args.out} if name in WRITES_FILES else {}
        try:
            rows = SUITES[name](dtype=dtype, quick=args.quick, **kwargs)
        except BenchmarkError as exc:
            print(f"{parser.prog}: {exc}", file=sys.stderr)
            return 1
        if rows is None:  # a rank other than 0 of a multi-process suite: rank 0 reports
            continue
        report(name, rows, env, args.out, timed=name not in HARDWARE_INDEPENDENT)
        results[name] = rows
    if len(results) > 1:  # the whole run's record beside the suites' own files
        print("wrote " + " and ".join(str(p) for p in write_summary(results, env, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
