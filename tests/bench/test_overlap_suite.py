"""The overlap suite on a CPU: measured bytes equal the ring formulas and every communicating pass overlaps."""

import pytest

from tessel.bench.overlap import OPS, gemms_in_flight, ring_bytes, run_overlap_suite


def test_gemms_in_flight_counts_gemms_between_a_send_and_its_wait():
    events = [("send", "op", 1), ("gemm", "op", 0), ("wait", "op", 1), ("gemm", "op", 1)]
    assert gemms_in_flight(events) == (1, 2)
    assert gemms_in_flight([("gemm", "op", 0)]) == (0, 1)


def test_ring_bytes_follow_the_ring_formulas():
    # t=4, m=2, n=3, k=5, fp32: all-gather of [8, 5] moves 3/4 of 160 bytes; all-reduce twice that of [8, 3].
    assert ring_bytes("all_gather_matmul", "forward", 4, 2, 3, 5, 4) == 120
    assert ring_bytes("matmul_all_reduce", "forward", 4, 2, 3, 5, 4) == 2 * 72
    assert ring_bytes("matmul_all_reduce", "backward", 4, 2, 3, 5, 4) == 0


@pytest.mark.multiprocess
def test_cpu_suite_reports_ring_bytes_and_overlapped_schedules():
    rows = run_overlap_suite(quick=True)
    assert {(r["op"], r["pass"]) for r in rows} == {(op, p) for op in OPS for p in ("forward", "backward")}
    for row in rows:
        assert row["tp"] == 2
        assert row["sent_bytes"] == row["ring_bytes"], row
        hidden, gemms = (int(v) for v in row["gemms_overlapped"].split("/"))
        if row["ring_bytes"]:  # every pass that communicates runs a GEMM while a transfer is in flight
            assert hidden >= 1, row
            assert gemms >= 2, row
