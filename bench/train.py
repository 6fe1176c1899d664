"""``torchrun --nproc_per_node=N -m tessel.bench.train [options]``: train tessel's GPT end to end.

Also ``python -m tessel.bench.train`` (a world of one). Trains the GPT of a size preset on the bundled
text (byte tokens) under any ``--dp × --cp × --pp × --tp`` layout, with ZeRO stages ``--zero`` and pipeline
schedules ``--schedule``; shows a progress bar on rank 0, prints a summary table, and writes under
``--out``: ``run.json`` (arguments, environment, every step's loss and time, the summary),
``loss.png``, checkpoints (``--save-every``, ``--resume``) and, with ``--profile``, Chrome traces. ``--init DIR``
starts from a Hugging Face checkpoint's weights (``python -m tessel.bench.export`` writes the job's as one).
``--help`` lists every option; ``bench/train_args.py`` holds the presets.

Without a GPU this runs on gloo with Triton's kernels in the interpreter (the default ``tiny`` preset
finishes in about a minute on two cores); on GPUs it runs NCCL and compiled kernels and reports
tokens per second and model FLOPs utilisation.
"""

from __future__ import annotations

import os
import sys

import torch

# Without a GPU, tessel's kernels run their plain-PyTorch references unless TRITON_INTERPRET=1 asks for
# Triton's interpreter. Measured on this 2-core CPU, one step of the tiny preset (4 layers, width 64,
# 8×64 tokens) takes ~0.1 s with the references and ~90 s in the interpreter (GEMMs ~70%, norms ~20%,
# attention ~15% of it), so the interpreter cannot train for even a minute; the tests prove the kernels
# through it on small shapes instead. Triton reads the flag when a kernel is defined, so it is decided
# here, before anything below imports triton or tessel.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "0")

from .train_args import PROG, ArgumentError, parse_args

__all__ = ["main"]


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and train; returns the exit status (2 for a bad argument, 1 for a failed run)."""
    try:
        args = parse_args(argv)
    except ArgumentError as exc:
        return _fail(str(exc), 2)
    from .checkpoint import CheckpointError
    from .train_loop import RunError, run

    try:
        run(args)
    except ArgumentError as exc:  # found once the model or a parallel module was built
        return _fail(str(exc), 2)
    except (CheckpointError, RunError) as exc:
        return _fail(str(exc), 1)
    return 0


def _exit(status: int) -> None:
    """End the process deliberately: with gloo and a DeviceMesh alive, interpreter shutdown can abort
    (DESIGN.md, "Process exit on gloo"); ``run`` has already passed a barrier and destroyed the groups."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    _exit(main())
