"""The benchmark scripts run (tiny grids) and write what they promise."""
import csv
import os

import pytest

import dtmt_kernels as dk


@pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")
def test_bench_cells_quick(tmp_path):
    from benchmarks import bench_cells
    rows = bench_cells.main(["--quick", "--out", str(tmp_path)])
    impls = {(r["kind"], r["impl"]) for r in rows}
    assert ("deep-transition", "cpp") in impls and ("gru", "torch.nn.GRU") in impls and ("atr", "reference") in impls
    with open(os.path.join(tmp_path, "bench_cells.csv")) as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    assert all(float(r["ms"]) > 0 and float(r["saved_B"]) > 0 for r in table)
