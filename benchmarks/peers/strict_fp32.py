"""Runs a Python module or script with TF32 off for cuBLAS and cuDNN: strict float32 on a GPU.

    python strict_fp32.py -m MODULE ARGS...
    python strict_fp32.py SCRIPT ARGS...

bench_peers.py --device cuda starts every training and translating process through it, dtmt's and OpenNMT-py's
alike, so that both sides run one math mode. torch's own defaults differ between the two libraries it calls: TF32
off for matrix products (cuBLAS) but on for cuDNN, so OpenNMT-py's cuDNN LSTM would run on TF32 tensor cores
against dtmt's strict float32 products. (Both sides' own clocks, which start when their module is imported, then
start after torch's import here; bench_peers' budgets are timed from each process's launch, outside it.)
"""
import os
import runpy
import sys

import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def main() -> None:
    # sys.path[0] as `python -m MODULE` or `python SCRIPT` would set it, not this file's folder
    if len(sys.argv) > 2 and sys.argv[1] == "-m":
        module = sys.argv[2]
        sys.argv = [module, *sys.argv[3:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    elif len(sys.argv) > 1:
        sys.argv = sys.argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        raise SystemExit("usage: strict_fp32.py -m MODULE ARGS... | strict_fp32.py SCRIPT ARGS...")


if __name__ == "__main__":
    main()
