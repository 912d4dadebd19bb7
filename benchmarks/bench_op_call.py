"""The cost of one call of the small-row linear, the op a decoder step calls most often (docs/design/cpu_kernels.md,
"The kernels as torch ops"):

    python benchmarks/bench_op_call.py            # in this checkout
    (cd OTHER_CHECKOUT && python /path/to/benchmarks/bench_op_call.py)   # the same in another, e.g. before a change

x [4, 256] times W [256, 256] + b, one thread; the minimum over 7 rounds of 2,000 calls, in µs per call, of the raw
op (torch.ops.dtmt.small_rows_linear, or the pybind `_C.small_rows_linear` of a checkout from before the ops were
registered with torch.library) and of `dtmt_kernels.functional.linear` around it. The package is imported from
the current directory, so that running it in another checkout measures that one.
"""
import os
import sys
import timeit

sys.path.insert(0, os.getcwd())


def main():
    import torch

    import dtmt_kernels as dk
    from dtmt_kernels import _C

    torch.set_num_threads(1)
    x, w, b = torch.randn(4, 256), torch.randn(256, 256), torch.randn(256)
    op = getattr(getattr(torch.ops, "dtmt", None), "small_rows_linear", None)
    raw = (lambda: op(x, w, b)) if op is not None else (lambda: _C.small_rows_linear(x, w, b))
    print(f"{dk.__file__} ({'torch.ops.dtmt' if op is not None else 'pybind _C'})")
    for name, fn in (("raw op", raw), ("functional.linear", lambda: dk.functional.linear(x, w, b))):
        t = min(timeit.repeat(fn, number=2000, repeat=7)) / 2000 * 1e6
        print(f"{name}: {t:.2f} us/call")


if __name__ == "__main__":
    main()
