"""Process groups, collectives, communication/GEMM overlap, DDP, FSDP, ZeRO and the pipeline scheduler."""

__all__: list[str] = []
