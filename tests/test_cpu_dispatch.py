"""The portable build (setup.py, csrc/cpu_dispatch.cpp): the CPU loops of csrc/isa/ are compiled once per
instruction set and the best one this CPU runs is chosen when the library loads.

- the choice is the best compiled instruction set whose features /proc/cpuinfo lists (and torch agrees);
  DTMT_CPU_ISA picks another, and an unusable value is ignored with a warning;
- every copy this machine can run computes the same numbers as the baseline x86-64 copy: the cells' forward and
  backward (all kinds, layer norm, T-GRUs, mask, candidate dropout, both directions), the attention scores and
  context with their gradients, the small-row linear and the row-panel products (float32 to rounding: vector width and FMA change the
  order of the sums; float64 to a few ulps);
- no code outside the copies' namespaces holds an instruction beyond baseline x86-64 (AVX, AVX-512, BMI, ...),
  which is what an inline function picked from the wrong copy at link time would show (objdump).
A DTMT_NATIVE=1 build has one copy, "native", and most of this does not apply to it.
"""
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch

import dtmt_kernels as dk
from conftest import make_layer, padding_mask
from dtmt_models.engine.forms import inference_form

pytestmark = pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")

if "cpp" in dk.available_backends():
    from dtmt_kernels import _C

    COMPILED = _C.compiled_cpu_isas()
    SUPPORTED = _C.supported_cpu_isas()
else:
    COMPILED = SUPPORTED = []
NATIVE = COMPILED == ["native"]
X86_LINUX = platform.machine() in ("x86_64", "AMD64") and sys.platform.startswith("linux")

# The CPU features each copy is compiled for (setup.py: -march=x86-64-v4 / -v3), as /proc/cpuinfo names them.
REQUIRES = {
    "avx512": {"avx2", "fma", "bmi1", "bmi2", "f16c", "abm", "movbe", "avx512f", "avx512bw", "avx512cd", "avx512dq",
               "avx512vl"},
    "avx2": {"avx2", "fma", "bmi1", "bmi2", "f16c", "abm", "movbe"},
    "baseline": set(),
}


def _cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _isa_at_load(env_value=None):
    """(the copy chosen when _C loads in a fresh process with DTMT_CPU_ISA=env_value, its stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "DTMT_CPU_ISA"}
    if env_value is not None:
        env["DTMT_CPU_ISA"] = env_value
    code = "import torch\nfrom dtmt_kernels import _C\nprint(_C.cpu_isa())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr


@pytest.mark.skipif(not X86_LINUX or NATIVE, reason="x86-64 Linux portable build only")
def test_chosen_copy_is_the_best_this_cpu_runs():
    flags = _cpu_flags()
    assert set(COMPILED) == {"avx512", "avx2", "baseline"}
    assert COMPILED == ["avx512", "avx2", "baseline"]  # best first
    expected = [isa for isa in COMPILED if REQUIRES[isa] <= flags]
    assert SUPPORTED == expected
    chosen, stderr = _isa_at_load()
    assert chosen == expected[0], stderr
    # torch's own dispatch (ATen's kernels) finds at least as wide a vector unit, unless ATEN_CPU_CAPABILITY caps it
    torch_isa = {"AVX512": "avx512", "AVX2": "avx2", "DEFAULT": "baseline"}.get(torch.backends.cpu.get_cpu_capability())
    if torch_isa is not None and "ATEN_CPU_CAPABILITY" not in os.environ:
        assert COMPILED.index(chosen) <= COMPILED.index(torch_isa)


@pytest.mark.skipif(NATIVE, reason="a DTMT_NATIVE=1 build has one copy")
def test_environment_variable_picks_a_copy_and_an_unusable_one_is_ignored():
    assert _isa_at_load("baseline")[0] == "baseline"
    chosen, stderr = _isa_at_load("sse9")
    assert chosen == SUPPORTED[0]
    assert "DTMT_CPU_ISA=sse9 ignored: not an instruction set of this build" in stderr
    assert f"running {SUPPORTED[0]}" in stderr


def test_set_cpu_isa_refuses_what_cannot_run():
    with pytest.raises(ValueError, match=r"'sse9' is not compiled into this build; choices here: "):
        _C.set_cpu_isa("sse9")
    for isa in set(COMPILED) - set(SUPPORTED):
        with pytest.raises(ValueError, match="not supported by this machine"):
            _C.set_cpu_isa(isa)
    assert _C.cpu_isa() in SUPPORTED


def _all_kernels(dtype):
    """Outputs and gradients of every op whose loops are in csrc/isa/, on fixed random inputs."""
    results = {}
    T, B, I, H = 7, 5, 11, 37
    mask = padding_mask([7, 5, 5, 2, 1], T, dtype)
    for cell, depth in (("gru", 2), ("lgru", 2), ("lau", 1), ("atr", 0)):
        for layer_norm in (False, True):
            layer = make_layer(cell, I, H, depth=depth, layer_norm=layer_norm, dtype=dtype)
            g = torch.Generator().manual_seed(3)
            x = torch.randn(T, B, I, generator=g, dtype=dtype, requires_grad=True)
            h0 = torch.randn(B, H, generator=g, dtype=dtype, requires_grad=True)
            drop = None if cell == "atr" else (torch.rand(depth + 1, B, H, generator=g) > 0.2).to(dtype) / 0.8
            for reverse in (False, True):
                w = layer.direction_weights(0, dict(layer.named_parameters()))
                out, h_n = dk.functional.transition_sequence(x, h0, w, mask, drop, reverse, "cpp")
                grads = torch.autograd.grad((out * out.detach().cos()).sum() + h_n.sum(),
                                            [x, h0, *layer.parameters()])
                key = f"{cell}-d{depth}-{'ln' if layer_norm else 'noln'}-{'rev' if reverse else 'fwd'}"
                results[key] = [out, h_n, *grads]
    g = torch.Generator().manual_seed(4)
    Bq, S, NH, D = 3, 13, 4, 17
    keys, q, v = (torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True)
                  for shape in ((Bq, S, NH, D), (Bq, NH, D), (NH, D)))
    scores = dk.functional.additive_scores(keys, q, v, "cpp")
    results["scores"] = [scores, *torch.autograd.grad((scores * scores.detach().sin()).sum(), [keys, q, v])]
    alpha = torch.softmax(torch.randn(Bq, NH, S, generator=g, dtype=dtype), -1).requires_grad_()
    values = torch.randn(S, Bq, NH * D, generator=g, dtype=dtype).transpose(0, 1).requires_grad_()  # strided
    context = dk.functional.attention_context(alpha, values, "cpp")
    results["context"] = [context, *torch.autograd.grad((context * context.detach().cos()).sum(), [alpha, values])]
    logits = 4 * torch.randn(9, 1037, generator=g, dtype=dtype)
    target = torch.randint(0, 1037, (9,), generator=g)
    target[[2, 7]] = -100
    results["loss"] = list(torch.ops.dtmt.smoothed_cross_entropy(logits, target, 0.1, -100))
    if dtype == torch.float32:
        for M in range(1, _C.SMALL_ROWS_MAX + 1):
            x, w, b = (torch.randn(*shape, generator=g) for shape in ((M, 301), (77, 301), (77,)))
            results[f"small-rows-{M}"] = [torch.ops.dtmt.small_rows_linear(x, w, b), torch.ops.dtmt.small_rows_linear(x, w, x.new_empty(0))]
        # the row-panel products (an encoder at batch 1: 4H = 148 and 3H = 111, part-filled last panels)
        torch.manual_seed(5)
        encoder = dk.nn.DeepTransitionGRU(I, H, depth=2, cell="lgru", layer_norm=True, bidirectional=True).eval()
        with torch.no_grad():
            results["row-panels"] = list(inference_form(encoder).with_row_panels()(
                torch.randn(T, 1, I, generator=g)))
    return results


@pytest.fixture
def restore_cpu_isa():
    before = _C.cpu_isa()
    yield
    _C.set_cpu_isa(before)


@pytest.mark.skipif(NATIVE or len(SUPPORTED) < 2, reason="this machine runs only the baseline copy")
@pytest.mark.parametrize("isa", [isa for isa in SUPPORTED if isa != "baseline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_copy_matches_baseline(isa, dtype, restore_cpu_isa):
    _C.set_cpu_isa("baseline")
    assert _C.cpu_isa() == "baseline"
    baseline = _all_kernels(dtype)
    _C.set_cpu_isa(isa)
    assert _C.cpu_isa() == isa
    wide = _all_kernels(dtype)
    assert wide.keys() == baseline.keys()
    # as tests/test_cpp_kernels.py against the reference: gradients are sums over T*B terms, so the absolute
    # tolerance scales with the tensor's magnitude
    atol, rtol = (2e-5, 1e-4) if dtype == torch.float32 else (1e-12, 1e-10)
    for key, tensors in baseline.items():
        for i, (a, b) in enumerate(zip(tensors, wide[key])):
            assert torch.isfinite(b).all(), (key, i)
            scale = max(1.0, a.abs().max().item())
            torch.testing.assert_close(b, a, atol=atol * scale, rtol=rtol, msg=lambda m: f"{key}, tensor {i}: {m}")


# Instructions beyond baseline x86-64: any VEX / EVEX-encoded one (mnemonics v*), ymm / zmm / mask registers, and
# the BMI1/2, LZCNT and MOVBE integer instructions of x86-64-v3. (tzcnt is left out: GCC emits it for any
# x86-64 as `rep bsf`, which older CPUs run as bsf.)
_SYSTEM_V = ("verr", "verw", "vmcall", "vmlaunch", "vmresume", "vmxoff", "vmxon", "vmread", "vmwrite", "vmptr",
             "vmclear", "vmfunc")
_BEYOND_X86_64 = {"andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "lzcnt", "mulx", "pdep", "pext", "rorx", "sarx",
                  "shlx", "shrx", "movbe"}
_WIDE_REGISTER = re.compile(r"%(?:[yz]mm\d+|k[0-7])\b")
_FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")
_INSTRUCTION = re.compile(r"^\s+[0-9a-f]+:\s+(.*)$")


def _beyond_baseline(instruction):
    words = instruction.split()
    while words and words[0] in ("rep", "repz", "repnz", "repe", "repne", "lock", "notrack", "bnd", "data16", "cs",
                                 "ds", "addr32", "{vex}", "{evex}"):
        words = words[1:]
    mnemonic = words[0] if words else ""
    return ((mnemonic.startswith("v") and not mnemonic.startswith(_SYSTEM_V)) or mnemonic in _BEYOND_X86_64
            or bool(_WIDE_REGISTER.search(instruction)))


@pytest.mark.skipif(not X86_LINUX or NATIVE or shutil.which("objdump") is None,
                    reason="x86-64 Linux portable build and objdump only")
def test_only_the_copies_hold_instructions_beyond_x86_64():
    proc = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", _C.__file__], capture_output=True,
                          text=True, check=True)
    outside, inside = {}, {"avx2": 0, "avx512": 0}
    zmm_in_avx512 = 0
    function = "?"
    for line in proc.stdout.splitlines():
        m = _FUNCTION.match(line)
        if m:
            function = m.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m or not _beyond_baseline(m.group(1)):
            continue
        copy = next((isa for isa in ("avx2", "avx512") if f"dtmt::{isa}::" in function), None)
        if copy is None:
            outside.setdefault(function, m.group(1))
        else:
            inside[copy] += 1
            zmm_in_avx512 += copy == "avx512" and "%zmm" in m.group(1)
    assert not outside, f"{len(outside)} functions outside csrc/isa/'s wide copies, e.g. {list(outside.items())[:5]}"
    # and the copies were compiled for their instruction sets
    assert inside["avx2"] > 1000 and inside["avx512"] > 1000 and zmm_in_avx512 > 100, (inside, zmm_in_avx512)
