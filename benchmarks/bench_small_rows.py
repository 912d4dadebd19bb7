"""The small-row loops as the extension compiles them, beside a plain read and, optionally, another version of them.

    python benchmarks/bench_small_rows.py [--against REV] [--isa avx512|avx2] [--rows 1,2,4,8] [--passes N] [--out DIR]

Compiles csrc/isa/small_gemm_rows.cpp as setup.py compiles that instruction set's copy of it (g++ -O3
-std=c++17 -fno-trapping-math, -march=x86-64-v4 for avx512, -v3 for avx2) into a small C++ program, and with
--against REV also the file as it was at git revision REV (`git show REV:csrc/isa/small_gemm_rows.cpp`, compiled
against today's headers) in a namespace of its own. On one thread, over the matrices a decoder step of the small
dtmt multiplies at batch 1 (the two cells' recurrent and T-GRU matrices, the attention's query, the readout's
from_s and the output layer: 6.1 MB of float32, one after another in 2 MiB pages, more than a core's L2), it times
one pass of `small_rows` (float32) and of `small_rows_int8` (int8 rows) over all of them for each M (rows of x: 4
is beam 4 at batch 1), medians of --passes passes, the versions alternated pass by pass, beside a plain sum over
the same float32 bytes (the rate the memory gives one core here). First it checks that the two versions give the
same outputs to the bit, for M = 1-8 on those shapes and one whose K is not a multiple of 16, with and without a
bias, over odd column ranges.

It found that GCC had kept the float32 loop's sums in memory (stored and reloaded around every group of weight
rows); `--against 8f6ee33~1` shows what that cost (a step's products at M = 4 took 1.14x the time on a Skylake-SP;
docs/design/cpu_kernels.md, "Sums kept in registers"). x86-64 Linux with g++ and git; Diagnosis of the kernel
alone, not a timing of the decoder (bench_step_phases.py, bench_decode.py). Output: a table on stdout and, with
--out, OUT/bench_small_rows.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

KERNEL = "csrc/isa/small_gemm_rows.cpp"
MARCH = {"avx512": "x86-64-v4", "avx2": "x86-64-v3"}
# [N, K] of the small dtmt's step matrices (query cell w_hh, T-GRU; attention query; decoder cell w_hh, T-GRU;
# readout from_s; output layer)
STEP_SHAPES = [(1024, 256), (768, 256), (256, 256), (1024, 256), (768, 256), (128, 256), (4000, 128)]

HARNESS = r"""
#include <sys/mman.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define DECLARE(ns)                                                                                               \
  namespace dtmt { namespace ns {                                                                                 \
  void small_rows(int, const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,     \
                  int64_t);                                                                                       \
  void small_rows_int8(int, const int8_t*, int64_t, const float*, const int8_t*, int64_t, int64_t, const float*,  \
                       float*, int64_t, int64_t, int64_t);                                                        \
  } }
DECLARE(cur)
#ifdef HAVE_REF
DECLARE(ref)
#endif

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static volatile float sink;
static void* pages(size_t bytes) {
  const size_t huge = size_t(2) << 20, n = (bytes + huge - 1) / huge * huge;
  void* p = aligned_alloc(huge, n);
#ifdef MADV_HUGEPAGE
  madvise(p, n, MADV_HUGEPAGE);
#endif
  return p;
}
__attribute__((noinline)) static float read_sum(const float* p, size_t n) {
  float s[16] = {0};
  for (size_t i = 0; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) s[j] += p[i + j];
  float t = 0;
  for (int j = 0; j < 16; ++j) t += s[j];
  return t;
}
static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

int main(int argc, char** argv) {
  const int passes = atoi(argv[1]);
  std::vector<int> rows;
  for (int i = 2; i < argc; ++i) rows.push_back(atoi(argv[i]));
  const int64_t shapes[][2] = {SHAPES};
  const int ns = sizeof(shapes) / sizeof(shapes[0]);
  size_t fbytes = 0, ibytes = 0;
  for (int s = 0; s < ns; ++s) { fbytes += shapes[s][0] * shapes[s][1] * 4; ibytes += shapes[s][0] * (shapes[s][1] + 4); }
  float* W = static_cast<float*>(pages(fbytes));
  int8_t* Q = static_cast<int8_t*>(pages(ibytes));
  for (size_t i = 0; i < fbytes / 4; ++i) W[i] = 0.1f * std::sin(0.013f * float(i));
  { size_t off = 0;
    for (int s = 0; s < ns; ++s) {
      const int64_t N = shapes[s][0], K = shapes[s][1];
      for (int64_t n = 0; n < N; ++n) {
        int8_t* r = Q + off + n * (K + 4);
        for (int64_t k = 0; k < K; ++k) r[k] = int8_t((n * 31 + k * 17) % 255 - 127);
        const float scale = 0.001f * float(1 + n % 7);
        std::memcpy(r + K, &scale, 4);
      }
      off += N * (K + 4);
    } }
  std::vector<float> x(8 * 512), xs(8), bias(8192), o1(8 * 8192), o2(8 * 8192);
  std::vector<int8_t> xq(8 * 512);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.37f * float(i));
  for (size_t i = 0; i < xq.size(); ++i) xq[i] = int8_t((i * 37) % 255 - 127);
  for (int m = 0; m < 8; ++m) xs[m] = 0.01f * float(m + 1);
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = 0.01f * float(i % 13);
  int checked = 0, differ = 0;
#ifdef HAVE_REF
  { // the same outputs to the bit: every M, the step's shapes and one with a K % 16 tail, bias or none, odd ranges
    const int64_t tail[2] = {1408, 148};
    float* T = static_cast<float*>(pages(tail[0] * tail[1] * 4));
    for (int64_t i = 0; i < tail[0] * tail[1]; ++i) T[i] = 0.1f * std::sin(0.029f * float(i));
    for (int M = 1; M <= 8; ++M) {
      size_t off = 0;
      for (int s = 0; s <= ns; ++s) {
        const int64_t N = s < ns ? shapes[s][0] : tail[0], K = s < ns ? shapes[s][1] : tail[1];
        const float* w = s < ns ? W + off : T;
        for (int b = 0; b < 2; ++b)
          for (int64_t n0 : {int64_t(0), int64_t(3)}) {
            const int64_t n1 = n0 ? N - 2 : N;   // N - 5 columns: leftover weight rows too
            std::fill(o1.begin(), o1.end(), 0.0f);
            std::fill(o2.begin(), o2.end(), 0.0f);
            dtmt::ref::small_rows(M, x.data(), 300, w, K, b ? bias.data() : nullptr, o1.data(), N, n0, n1);
            dtmt::cur::small_rows(M, x.data(), 300, w, K, b ? bias.data() : nullptr, o2.data(), N, n0, n1);
            ++checked;
            differ += std::memcmp(o1.data(), o2.data(), o1.size() * 4) != 0;
          }
        if (s < ns) off += N * K;
      }
      size_t qoff = 0;
      for (int s = 0; s < ns; ++s) {
        const int64_t N = shapes[s][0], K = shapes[s][1];
        for (int b = 0; b < 2; ++b) {
          std::fill(o1.begin(), o1.end(), 0.0f);
          std::fill(o2.begin(), o2.end(), 0.0f);
          dtmt::ref::small_rows_int8(M, xq.data(), 300, xs.data(), Q + qoff, K, K + 4, b ? bias.data() : nullptr,
                                     o1.data(), N, 1, N - 2);
          dtmt::cur::small_rows_int8(M, xq.data(), 300, xs.data(), Q + qoff, K, K + 4, b ? bias.data() : nullptr,
                                     o2.data(), N, 1, N - 2);
          ++checked;
          differ += std::memcmp(o1.data(), o2.data(), o1.size() * 4) != 0;
        }
        qoff += N * (K + 4);
      }
    }
  }
#endif
  std::vector<double> t_read;
  for (int p = 0; p < passes; ++p) { const double t0 = now(); sink = read_sum(W, fbytes / 4); t_read.push_back(now() - t0); }
  printf("{\"float_bytes\": %zu, \"int8_bytes\": %zu, \"checked\": %d, \"differ\": %d, \"read_us\": %.2f, \"rows\": [",
         fbytes, ibytes, checked, differ, median(t_read) * 1e6);
  for (size_t i = 0; i < rows.size(); ++i) {
    const int M = rows[i];
    std::vector<double> t[4];   // float cur, float ref, int8 cur, int8 ref
    for (int p = 0; p < passes; ++p)
      for (int v = 0; v < 4; ++v) {
#ifndef HAVE_REF
        if (v & 1) continue;
#endif
        const double t0 = now();
        size_t off = 0, qoff = 0;
        for (int s = 0; s < ns; ++s) {
          const int64_t N = shapes[s][0], K = shapes[s][1];
          if (v == 0) dtmt::cur::small_rows(M, x.data(), K, W + off, K, bias.data(), o1.data(), N, 0, N);
          if (v == 2) dtmt::cur::small_rows_int8(M, xq.data(), K, xs.data(), Q + qoff, K, K + 4, bias.data(), o1.data(), N, 0, N);
#ifdef HAVE_REF
          if (v == 1) dtmt::ref::small_rows(M, x.data(), K, W + off, K, bias.data(), o1.data(), N, 0, N);
          if (v == 3) dtmt::ref::small_rows_int8(M, xq.data(), K, xs.data(), Q + qoff, K, K + 4, bias.data(), o1.data(), N, 0, N);
#endif
          off += N * K;
          qoff += N * (K + 4);
        }
        t[v].push_back(now() - t0);
      }
    printf("%s{\"M\": %d, \"float_us\": %.2f, \"int8_us\": %.2f", i ? ", " : "", M, median(t[0]) * 1e6, median(t[2]) * 1e6);
#ifdef HAVE_REF
    printf(", \"float_ref_us\": %.2f, \"int8_ref_us\": %.2f", median(t[1]) * 1e6, median(t[3]) * 1e6);
#endif
    printf("}");
  }
  printf("]}\n");
  return 0;
}
"""


def _fail(message: str) -> "SystemExit":
    return SystemExit(f"bench_small_rows: {message}")


def measure(isa: str, rows, passes: int, against=None) -> dict:
    """Builds the harness (and REV's loops with `against`) and returns its figures (see the module docstring)."""
    gxx = shutil.which("g++")
    if gxx is None:
        raise _fail("needs g++ (the compiler the extension builds with)")
    shapes = ", ".join(f"{{{n}, {k}}}" for n, k in STEP_SHAPES)
    common = [gxx, "-O3", "-std=c++17", "-fno-trapping-math", f"-march={MARCH[isa]}",
              "-I", os.path.join(ROOT, "csrc", "isa"), "-I", os.path.join(ROOT, "csrc")]
    with tempfile.TemporaryDirectory() as tmp:
        objects = [(os.path.join(ROOT, KERNEL), "cur")]
        if against:
            if shutil.which("git") is None:
                raise _fail("--against needs git")
            old = subprocess.run(["git", "-C", ROOT, "show", f"{against}:{KERNEL}"], capture_output=True, text=True)
            if old.returncode != 0:
                raise _fail(f"no {KERNEL} at {against!r}: {(old.stderr.strip().splitlines() or ['?'])[-1]}")
            path = os.path.join(tmp, "ref_small_gemm_rows.cpp")
            with open(path, "w") as f:
                f.write(old.stdout)
            objects.append((path, "ref"))
        harness, exe = os.path.join(tmp, "harness.cpp"), os.path.join(tmp, "harness")
        with open(harness, "w") as f:
            f.write(HARNESS.replace("SHAPES", shapes))
        try:
            built = []
            for src, ns in objects:
                obj = os.path.join(tmp, f"{ns}.o")
                subprocess.run(common + [f"-DDTMT_ISA={ns}", "-c", src, "-o", obj], check=True, capture_output=True,
                               text=True)
                built.append(obj)
            subprocess.run(common + (["-DHAVE_REF"] if against else []) + [harness] + built + ["-o", exe],
                           check=True, capture_output=True, text=True)
            out = subprocess.run([exe, str(passes)] + [str(m) for m in rows], check=True, capture_output=True,
                                 text=True).stdout
        except subprocess.CalledProcessError as e:
            lines = (e.stderr or "").strip().splitlines()
            raise _fail(f"{os.path.basename(e.cmd[0])} failed: {lines[-1] if lines else e}") from None
    r = json.loads(out)
    r.update(isa=isa, against=against, passes=passes, shapes=STEP_SHAPES)
    return r


def table(r: dict, machine: str) -> str:
    mb, read_us = r["float_bytes"] / 1e6, r["read_us"]
    cmd = f"`python benchmarks/bench_small_rows.py --isa {r['isa']}" + (f" --against {r['against']}`" if r["against"]
                                                                        else "`")
    lines = [f"The small-row loops of {KERNEL} ({r['isa']} copy), {machine}, one thread ({cmd}): one pass over a "
             f"small dtmt step's {len(r['shapes'])} matrices, {mb:.2f} MB float32 / {r['int8_bytes'] / 1e6:.2f} MB "
             f"int8, medians of {r['passes']} passes; a plain sum over the float32 bytes takes {read_us:.0f} µs "
             f"({r['float_bytes'] / read_us / 1e3:.1f} GB/s)."]
    if r["against"]:
        same = "the same to the bit" if r["differ"] == 0 else f"DIFFERENT in {r['differ']}"
        lines[0] += (f" Against the file at {r['against']}, passes alternated; outputs {same} in {r['checked']} "
                     f"checks.")
    head = "| rows (M) | float32 µs | GB/s | int8 µs |"
    rule = "|---:|---:|---:|---:|"
    if r["against"]:
        head += " float32 µs, ref | now / ref | int8 µs, ref | now / ref |"
        rule += "---:|---:|---:|---:|"
    lines += ["", head, rule]
    for row in r["rows"]:
        line = (f"| {row['M']} | {row['float_us']:.0f} | {r['float_bytes'] / row['float_us'] / 1e3:.1f} | "
                f"{row['int8_us']:.0f} |")
        if r["against"]:
            line += (f" {row['float_ref_us']:.0f} | {row['float_us'] / row['float_ref_us']:.3f} | "
                     f"{row['int8_ref_us']:.0f} | {row['int8_us'] / row['int8_ref_us']:.3f} |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default=None, metavar="REV", help="also time (and check) the loops at git REV")
    p.add_argument("--isa", choices=sorted(MARCH), default=None,
                   help="the copy to build (default: the one the extension runs on this CPU)")
    p.add_argument("--rows", default="1,2,4,8", help="values of M, comma-separated (1-8)")
    p.add_argument("--passes", type=int, default=1000)
    p.add_argument("--out", default=None, help="write bench_small_rows.md and .json here")
    a = p.parse_args(argv)
    from common import check_options

    check_options(p, a, (("passes", 1),))
    if a.against is not None and (not a.against or a.against.startswith("-")):   # (read by git as an option:
        p.error(f"--against {a.against}: not a git revision")                   # --output=FILE wrote a file)
    try:
        rows = [int(m) for m in a.rows.split(",")]
    except ValueError:
        p.error(f"--rows takes whole numbers separated by commas, got {a.rows!r}")
    if not rows or any(m < 1 or m > 8 for m in rows):
        p.error(f"--rows must be between 1 and 8, got {a.rows!r}")
    if a.passes < 1:
        p.error("--passes must be >= 1")
    from common import machine_name, make_out_dir, write_report

    if a.out:   # (after the checks, before the measurement: an --out that cannot be made failed after it)
        make_out_dir(p, a.out)

    isa = a.isa
    if isa is None:
        from dtmt_kernels import _C

        isa = _C.cpu_isa()
        if isa not in MARCH:
            raise _fail(f"the extension runs its {isa!r} loops on this CPU; the probe needs AVX2 (--isa avx2)")
    r = measure(isa, rows, a.passes, a.against)
    text = table(r, machine_name(threads=False))
    print(text, end="")
    if a.out:
        write_report(a.out, "bench_small_rows", text, r)
    if r["against"] and r["differ"]:
        raise _fail(f"the loops at {r['against']} and now differ in {r['differ']} of {r['checked']} checks")
    return r


if __name__ == "__main__":
    main()
