"""Builds dtmt_kernels._C against the torch already installed.

    pip install --no-build-isolation .        (or -e . for development)

C++ CPU kernels are always built (C++17, OpenMP). CUDA sources (csrc/*.cu) are added when the installed
torch has CUDA and nvcc is found, unless DTMT_NO_CUDA=1. The CPU code is compiled for the build machine
(-march=native) since the package is built from source where it runs; DTMT_PORTABLE=1 turns that off.
-fno-trapping-math lets GCC turn the clamps and selects of the float exp/sigmoid/tanh (cell_math.h) into
vector blends: without it none of the per-feature loops that call them vectorises (GCC 12 reports "control
flow in loop"). The kernels never read floating-point exception flags, so nothing else changes.
"""
import glob
import os
import platform

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def extension():
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cu_sources = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-fno-trapping-math"]
    if not _flag("DTMT_PORTABLE") and platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        cxx.append("-march=native")
    with_cuda = (
        torch.version.cuda is not None and CUDA_HOME is not None and bool(cu_sources) and not _flag("DTMT_NO_CUDA")
    )
    kwargs = dict(
        name="dtmt_kernels._C",
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_link_args=["-fopenmp"],
    )
    if with_cuda:
        return CUDAExtension(
            sources=cpp_sources + cu_sources,
            define_macros=[("DTMT_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]},
            **kwargs,
        )
    return CppExtension(sources=cpp_sources, extra_compile_args={"cxx": cxx}, **kwargs)


setup(
    packages=find_packages(include=["dtmt_kernels", "dtmt_kernels.*", "dtmt_models", "dtmt_models.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
