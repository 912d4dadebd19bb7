"""Builds dtmt_kernels._C against the torch already installed.

    pip install --no-build-isolation .        (or -e . for development)

C++ CPU kernels are always built (C++17, OpenMP). CUDA sources (csrc/*.cu) are added when the installed
torch has CUDA and nvcc is found, unless DTMT_NO_CUDA=1.

The library runs on any x86-64 CPU and uses the vector units it has. The hot loops (csrc/isa/: the cells' row
passes, additive attention, the small-row GEMM; no torch headers) are compiled once per instruction set, baseline
x86-64, AVX2 (-march=x86-64-v3) and AVX-512 (-march=x86-64-v4), each copy in its own namespace, and
csrc/cpu_dispatch.cpp picks the best one the CPU supports when the library loads (DTMT_CPU_ISA=baseline|avx2|avx512
asks for another; `_C.cpu_isa()` says which runs). The rest (allocation, GEMM calls, threads) is compiled for
baseline x86-64. DTMT_NATIVE=1 compiles everything for the build machine instead (-march=native, one copy of the
loops, named "native"): the library then runs only on CPUs like it. Other architectures build one copy for the
compiler's default target.
-fno-trapping-math lets GCC turn the clamps and selects of the float exp/sigmoid/tanh (cell_math.h) into
vector blends: without it none of the per-feature loops that call them vectorises (GCC 12 reports "control
flow in loop"). The kernels never read floating-point exception flags, so nothing else changes.
DTMT_DEBUG=1 compiles with debug information (-g; without it -g0 overrides the -g of Python's flags).
DTMT_SANITIZE=address compiles with AddressSanitizer and UndefinedBehaviorSanitizer (-O1 -g, every undefined
behaviour fatal): `.ci/sanitize` builds such a copy apart and runs the kernel and fuzz tests against it.
DTMT_PHASE_TIMERS=1 compiles in the decoding search's phase timers (csrc/phase_timers.h; read by
benchmarks/bench_step_phases.py); without it they are empty statements.
"""
import concurrent.futures
import contextlib
import glob
import os
import platform

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
ISA_SOURCES = sorted(glob.glob(os.path.join("csrc", "isa", "*.cpp")))


def write_cell_layout() -> None:
    """csrc/cell_layout.inc from the cells' table (dtmt_kernels/ops/transition/layout.py, CELLS), where it differs:
    the one table that Python, Triton, C++ and CUDA read. layout.py is loaded alone (torch only), not through the
    package, which would load the extension being built."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_dtmt_layout", os.path.join(HERE, "dtmt_kernels", "ops", "transition", "layout.py"))
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    path, text = os.path.join(HERE, "csrc", "cell_layout.inc"), layout.cell_layout_header()
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def cpu_isas():
    """{name: extra compiler flags} of the copies of csrc/isa/ to build, best first (csrc/cpu_dispatch.cpp
    keeps this order)."""
    if _flag("DTMT_NATIVE"):
        return {"native": ["-march=native"]}
    if platform.machine() in ("x86_64", "AMD64"):
        return {"avx512": ["-march=x86-64-v4"], "avx2": ["-march=x86-64-v3"], "baseline": []}
    return {"baseline": []}


def sanitizers():
    """The flags of DTMT_SANITIZE (compiling and linking): none, or AddressSanitizer + UndefinedBehaviorSanitizer.
    (vptr is left out: torch's classes come from libraries built without it.)"""
    kind = os.environ.get("DTMT_SANITIZE", "")
    if kind in ("", "0"):
        return []
    if kind != "address":
        raise SystemExit(f"DTMT_SANITIZE={kind}: only 'address' (AddressSanitizer + UndefinedBehaviorSanitizer) exists")
    return ["-fsanitize=address,undefined", "-fno-sanitize=vptr", "-fno-sanitize-recover=all"]


def base_cxx_flags():
    sanitize = sanitizers()
    flags = ["-O1" if sanitize else "-O3", "-std=c++17", "-fopenmp", "-fno-trapping-math"]
    # Python's own flags carry -g: debug information for torch's headers takes a quarter of the compile time and
    # most of the library's size; DTMT_DEBUG=1 keeps it (and a sanitized build, for its reports' line numbers)
    flags.append("-g" if _flag("DTMT_DEBUG") or sanitize else "-g0")
    if sanitize:
        flags += sanitize + ["-fno-omit-frame-pointer"]
    if _flag("DTMT_PHASE_TIMERS"):
        flags.append("-DDTMT_PHASE_TIMERS")
    if _flag("DTMT_NATIVE"):
        flags.append("-march=native")
    elif platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=x86-64")  # whatever the compiler's default: the code outside csrc/isa/ runs anywhere
    return flags


class BuildExtensionWithIsaCopies(BuildExtension):
    """torch's BuildExtension, plus one copy of csrc/isa/*.cpp per instruction set of cpu_isas(), each compiled
    with the extension's flags, that set's -march and -DDTMT_ISA=<name> into a folder of its own, and linked
    into the extension. (setuptools compiles every source of an extension with the same flags, hence this.)"""

    def build_extension(self, ext):
        cxx = ext.extra_compile_args["cxx"] if isinstance(ext.extra_compile_args, dict) else ext.extra_compile_args
        # flags other than the last build's (DTMT_NATIVE, DTMT_PHASE_TIMERS): setuptools would call the extension up
        # to date, no source being newer than it, and keep the old build; so build it anew (ninja then recompiles
        # what the new flags change)
        stamp = os.path.join(self.build_temp, "dtmt_flags.txt")
        flags_now = " ".join(cxx + [f"{isa}: {' '.join(f)}" for isa, f in cpu_isas().items()] +
                             [f"-D{name}={value}" for name, value in ext.define_macros])
        with contextlib.suppress(OSError), open(stamp) as f:
            if f.read() != flags_now:
                self.force = True
        if not os.path.exists(stamp):
            self.force = True

        def compile_copy(isa, flags):
            return self.compiler.compile(ISA_SOURCES, output_dir=os.path.join(self.build_temp, "isa", isa),
                                         include_dirs=ext.include_dirs, debug=self.debug,
                                         extra_postargs=cxx + flags + [f"-DDTMT_ISA={isa}"])

        # the copies at once (each is a ninja run of its own): a few seconds of torch-free code each
        with concurrent.futures.ThreadPoolExecutor() as pool:
            copies = [pool.submit(compile_copy, isa, flags) for isa, flags in cpu_isas().items()]
            ext.extra_objects = [obj for copy in copies for obj in copy.result()]
        super().build_extension(ext)
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(flags_now)


def _cublas_library_dir():
    """The folder of libcublas in the CUDA toolkit torch builds against, when that toolkit also has the headers
    torch's ATen/cuda/CUDAContextLight.h includes (a toolkit of nvcc alone has neither); else None."""
    if CUDA_HOME is None:
        return None
    headers = ("cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h")
    if not all(os.path.exists(os.path.join(CUDA_HOME, "include", h)) for h in headers):
        return None
    found = [f for lib in ("lib64", "lib", "targets/*/lib")
             for f in glob.glob(os.path.join(CUDA_HOME, lib, "libcublas.so"))]   # (what -lcublas links)
    return os.path.dirname(found[0]) if found else None


def sm90a_only() -> bool:
    """Whether TORCH_CUDA_ARCH_LIST asks for compute capability 9.0 only as its arch-specific code (9.0a), so that
    every kernel the extension runs on a 9.0 device has the bulk copies' multicast (csrc/persistent_cuda_kernels.cuh:
    DTMT_SM90A tells the host code that they do)."""
    arches = [a.split("+")[0] for a in os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(" ", ";").split(";")]
    return "9.0a" in arches and "9.0" not in arches


def extension():
    write_cell_layout()
    # csrc/ holds the kernels, csrc/engine/ the inference engine's ops (decoder step, beam search)
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "engine", "*.cpp")))
    cu_sources = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    cxx = base_cxx_flags()
    with_cuda = (
        torch.version.cuda is not None and CUDA_HOME is not None and bool(cu_sources) and not _flag("DTMT_NO_CUDA")
    )
    kwargs = dict(
        name="dtmt_kernels._C",
        include_dirs=[os.path.join(HERE, "csrc")],
        # cpu_dispatch.cpp lists the copies of csrc/isa/ that are linked in
        define_macros=[(f"DTMT_ISA_{isa.upper()}", "1") for isa in cpu_isas()],
        # rebuild when a header or a copied source changes, not only the sources above
        depends=sorted(glob.glob(os.path.join("csrc", "*.h")) + glob.glob(os.path.join("csrc", "*.cuh")) +
                       glob.glob(os.path.join("csrc", "isa", "*")) + glob.glob(os.path.join("csrc", "engine", "*.h")) +
                       glob.glob(os.path.join("csrc", "*.inc"))),
        extra_link_args=["-fopenmp"] + sanitizers(),
    )
    if with_cuda:
        macros = kwargs["define_macros"] + [("DTMT_WITH_CUDA", "1")]
        if sm90a_only():
            # the persistent launches' stage read once a cluster (bulk copies multicast: code for sm_90a only;
            # docs/design/persistent_recurrence.md, "The stage read once a cluster")
            macros.append(("DTMT_SM90A", "1"))
        libraries, library_dirs = [], []
        cublas_dir = _cublas_library_dir()
        if cublas_dir is not None:
            # the step GEMMs' direct cuBLAS calls (csrc/transition_cuda.cu, DTMT_CUDA_STEP_GEMM=cublas-direct)
            macros.append(("DTMT_DIRECT_CUBLAS", "1"))
            libraries.append("cublas")
            library_dirs.append(cublas_dir)
        else:
            print(f"dtmt: no cuBLAS headers under {CUDA_HOME}: built without the step GEMMs' direct cuBLAS calls")
        return CUDAExtension(
            sources=cpp_sources + cu_sources,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]},
            libraries=libraries,
            library_dirs=library_dirs,
            **{**kwargs, "define_macros": macros},
        )
    return CppExtension(sources=cpp_sources, extra_compile_args={"cxx": cxx}, **kwargs)


setup(
    packages=find_packages(include=["dtmt_kernels", "dtmt_kernels.*", "dtmt_models", "dtmt_models.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtensionWithIsaCopies.with_options(use_ninja=True)},
)
