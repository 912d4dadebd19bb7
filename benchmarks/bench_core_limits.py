"""What one core of this machine gives a float32 decoding step: multiply-adds per second and read rates.

    python benchmarks/bench_core_limits.py [--out DIR]

A decoding step at batch 1 multiplies every weight it reads by each of its M rows (M = 4 for beam 4), so it is
bounded twice: by how fast the core reads the ~7 MB of a step's weights (more than its L2 holds, so from L3 or
memory) and by how many multiply-adds it retires (M vector FMAs for every 64 bytes of weights). This probe measures
both on one thread, in a small C++ program compiled here with g++ -O3 -march=native (AVX-512 where the CPU has it,
else AVX2):

- FMA throughput: independent chains of 512-bit (and 256-bit) fused multiply-adds, ns per instruction;
- read rate: a sum over 1 MiB read again and again (within L2 on a CPU of 2 MiB of L2 a core, as the Xeon 167
  of docs/design/cpu_kernels.md), over 1.75 MiB (a batch-1 encoder direction's recurrent matrices for the small
  dtmt, at the edge of such an L2) and over 7 MiB (past it), in 2 MiB pages;
- the multiply-add stream: M rows of x times a 7 MiB stream of weight rows (the shape of the small-row loop of
  csrc/isa/small_gemm_rows.cpp: R = 4 weight rows at a time, 2 with AVX2 only, each chunk of x loaded once for
  them), GB/s of weights for M = 1 and 4, beside the FMA bound (vector bytes) / (M x ns per FMA).
- the weighing of a step's source products (a sentence's NH x S rows of the context's products, read 96 columns at
  a time as weigh_products reads them): alone, again and again (from L2), and after each 7 MiB read of a step's
  weights (which evicts them), the stream read plainly or with non-temporal prefetches: can a hint keep the
  products in L2 while the weights stream past? (No, on the Xeon 167: docs/design/cpu_kernels.md, "Weights on
  2 MiB pages".)

x86-64 with AVX2 and FMA, Linux (2 MiB pages by madvise), g++.

Diagnosis, not a timing of the package's code (bench_int8_kernel.py times its kernel on a real decoder's
matrices). Output: a table on stdout and, with --out, OUT/bench_core_limits.md and .json.
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
sys.path.insert(0, HERE)

SOURCE = r"""
#include <immintrin.h>
#include <sys/mman.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the probe needs AVX2 and FMA (x86-64-v3)"
#endif

#if defined(__AVX512F__)
typedef __m512 vec;
constexpr int W = 16;
constexpr int R = 4;   // weight rows at a time: M x R accumulators, R weights and x's chunk within 32 registers
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vset(float x) { return _mm512_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
#else
typedef __m256 vec;
constexpr int W = 8;
constexpr int R = 2;   // within AVX2's 16 registers (R = 4 at 4 rows would spill accumulators to the stack)
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vset(float x) { return _mm256_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline float vsum(vec a) { float t[8]; _mm256_storeu_ps(t, a); float s = 0; for (float v : t) s += v; return s; }
#endif

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static volatile float sink;

static float* pages(size_t bytes) {   // 2 MiB-aligned, advised into 2 MiB pages, written once
  const size_t al = size_t(2) << 20;
  void* m = mmap(nullptr, bytes + al, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) { std::perror("mmap"); std::exit(1); }
  char* b = (char*)(((uintptr_t)m + al - 1) & ~(uintptr_t)(al - 1));
#ifdef MADV_HUGEPAGE
  madvise(b, bytes, MADV_HUGEPAGE);
#endif
  float* f = (float*)b;
  for (size_t i = 0; i < bytes / 4; ++i) f[i] = float(i % 97) * 1e-3f;
  return f;
}

template <typename F> static double median_of(int reps, F f) {   // seconds, the median of reps calls
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) { double t0 = now(); f(); t.push_back(now() - t0); }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

__attribute__((noinline)) static void fma512_chains(int64_t n) {
#if defined(__AVX512F__)
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_ps(i * 1e-3f);
  const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
  for (int64_t it = 0; it < n; ++it)
    for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
  float s = 0; for (int i = 0; i < 16; ++i) s += _mm512_reduce_add_ps(a[i]); sink = s;
#endif
}

// 12 chains: enough to cover the FMA's latency on two units, few enough to stay in AVX2's 16 registers
__attribute__((noinline)) static void fma256_chains(int64_t n) {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(i * 1e-3f);
  const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
  for (int64_t it = 0; it < n; ++it)
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
  float t[8]; float s = 0; for (int i = 0; i < 12; ++i) { _mm256_storeu_ps(t, a[i]); s += t[0]; } sink = s;
}

__attribute__((noinline)) static float read_sum(const float* p, size_t n) {
  vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  for (size_t i = 0; i + 4 * W <= n; i += 4 * W) {
    a0 = vadd(a0, vload(p + i)); a1 = vadd(a1, vload(p + i + W));
    a2 = vadd(a2, vload(p + i + 2 * W)); a3 = vadd(a3, vload(p + i + 3 * W));
  }
  return vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
}

// M rows of x [M, K] times weight rows [N, K], R weight rows at a time (x's chunk loaded once for them)
template <int M> __attribute__((noinline)) static void rows_stream(const float* x, const float* w, int64_t N, int64_t K,
                                                                   float* out) {
  for (int64_t n = 0; n + R <= N; n += R) {
    vec acc[M][R];
    for (int m = 0; m < M; ++m) for (int r = 0; r < R; ++r) acc[m][r] = vzero();
    const float* wr = w + n * K;
    for (int64_t k = 0; k < K; k += W) {
      vec wv[R];
      for (int r = 0; r < R; ++r) {
        _mm_prefetch((const char*)(wr + r * K + k + 1024), _MM_HINT_T0);
        wv[r] = vload(wr + r * K + k);
      }
      for (int m = 0; m < M; ++m) {
        const vec xv = vload(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] = vfma(xv, wv[r], acc[m][r]);
      }
    }
    for (int m = 0; m < M; ++m) for (int r = 0; r < R; ++r) out[m * N + n + r] = vsum(acc[m][r]);
  }
}

// The weighing of a step's source products (csrc/isa/attention_loops.cpp, weigh_products): rows of ld floats, one
// chunk of 96 columns at a time over all rows (a sentence's NH x S rows, 5.6 KB apart)
__attribute__((noinline)) static float weigh_read(const float* p, int64_t rows, int64_t ld) {
  vec acc[96 / W];
  for (int v = 0; v < 96 / W; ++v) acc[v] = vzero();
  for (int64_t c = 0; c + 96 <= ld; c += 96)
    for (int64_t k = 0; k < rows; ++k)
      for (int v = 0; v < 96 / W; ++v) acc[v] = vadd(acc[v], vload(p + k * ld + c + v * W));
  vec s = vzero();
  for (int v = 0; v < 96 / W; ++v) s = vadd(s, acc[v]);
  return vsum(s);
}

// read_sum with a non-temporal prefetch of every line 32 lines ahead (a hint to keep the stream out of L2)
__attribute__((noinline)) static float read_sum_nta(const float* p, size_t n) {
  vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  for (size_t i = 0; i + 4 * W <= n; i += 4 * W) {
    for (size_t line = 0; line < 4 * W * sizeof(float); line += 64)   // the lines this pass reads (4 or 2)
      _mm_prefetch((const char*)(p + i) + line + 32 * 64, _MM_HINT_NTA);
    a0 = vadd(a0, vload(p + i)); a1 = vadd(a1, vload(p + i + W));
    a2 = vadd(a2, vload(p + i + 2 * W)); a3 = vadd(a3, vload(p + i + 3 * W));
  }
  return vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
}

int main() {
  const int64_t n_fma = 20000000;   // iterations of 16 FMAs
  const double ns512 = median_of(5, [&] { fma512_chains(n_fma); }) / (16.0 * n_fma) * 1e9;
  const double ns256 = median_of(5, [&] { fma256_chains(n_fma); }) / (12.0 * n_fma) * 1e9;
  const size_t small = size_t(1) << 20, edge = size_t(7) << 18, big = size_t(7) << 20;
  float* b = pages(big);
  const double l2 = small / median_of(400, [&] { sink = read_sum(b, small / 4); }) / 1e9;
  const double l2_edge = edge / median_of(400, [&] { sink = read_sum(b, edge / 4); }) / 1e9;
  const double past = big / median_of(100, [&] { sink = read_sum(b, big / 4); }) / 1e9;
  const int64_t K = 256, N = int64_t(big / 4 / K);
  std::vector<float> x(4 * K, 0.01f), out(4 * N);
  const double m1 = big / median_of(60, [&] { rows_stream<1>(x.data(), b, N, K, out.data()); }) / 1e9;
  const double m4 = big / median_of(60, [&] { rows_stream<4>(x.data(), b, N, K, out.data()); }) / 1e9;
  // a sentence's source products (NH = 4 heads x S = 35 positions, rows of 1,408: 0.79 MB) weighed alone, and after
  // each 7 MiB stream of a step's weights, read plainly or with non-temporal prefetches
  const int64_t p_rows = 140, p_ld = 1408;
  float* pp = pages(size_t(p_rows * p_ld * 4));
  const double p_bytes = double(p_rows * (p_ld / 96 * 96) * 4);   // the columns weigh_read reads (1,344 of 1,408)
  const double w_hot = p_bytes / median_of(200, [&] { sink = weigh_read(pp, p_rows, p_ld); }) / 1e9;
  std::vector<double> tw, tn, tw_nta;
  for (int r = 0; r < 60; ++r) {
    double t0 = now(); sink = read_sum(b, big / 4);
    double t1 = now(); sink = weigh_read(pp, p_rows, p_ld);
    double t2 = now(); sink = read_sum_nta(b, big / 4);
    double t3 = now(); sink = weigh_read(pp, p_rows, p_ld);
    double t4 = now();
    tw.push_back(t2 - t1); tn.push_back(t3 - t2); tw_nta.push_back(t4 - t3);
  }
  for (auto* v : {&tw, &tn, &tw_nta}) std::sort(v->begin(), v->end());
  const double w_after = p_bytes / tw[30] / 1e9, nta = big / tn[30] / 1e9, w_after_nta = p_bytes / tw_nta[30] / 1e9;
  std::printf("{\"vector_floats\": %d, \"ns_per_fma512\": %.4f, \"ns_per_fma256\": %.4f, \"read_l2_gbs\": %.2f, "
              "\"read_1_75mib_gbs\": %.2f, \"read_7mib_gbs\": %.2f, \"rows1_7mib_gbs\": %.2f, \"rows4_7mib_gbs\": %.2f, "
              "\"weigh_hot_gbs\": %.2f, \"weigh_after_stream_gbs\": %.2f, \"read_7mib_nta_gbs\": %.2f, "
              "\"weigh_after_nta_stream_gbs\": %.2f}\n",
              W, W == 16 ? ns512 : 0.0, ns256, l2, l2_edge, past, m1, m4, w_hot, w_after, nta, w_after_nta);
  return 0;
}
"""


def measure() -> dict:
    """Compiles the probe with g++ -O3 -march=native and returns its figures (see the module docstring)."""
    gxx = shutil.which("g++")
    if gxx is None:
        raise SystemExit("bench_core_limits: needs g++ (the compiler the extension builds with)")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "core_limits.cpp"), os.path.join(tmp, "core_limits")
        with open(src, "w") as f:
            f.write(SOURCE)
        try:
            subprocess.run([gxx, "-O3", "-march=native", "-o", exe, src], check=True, capture_output=True, text=True)
            r = json.loads(subprocess.run([exe], check=True, capture_output=True, text=True).stdout.strip())
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"bench_core_limits: the probe failed ({' '.join(e.cmd[:2])}): "
                             f"{(e.stderr or '').strip().splitlines()[-1:] or e}") from None
    ns = r["ns_per_fma512"] or r["ns_per_fma256"]          # the widest vector the loops use
    width_bytes = 4 * r["vector_floats"]
    r["fma_bound_rows1_gbs"] = width_bytes / ns             # bytes of weights a second if only the FMAs counted
    r["fma_bound_rows4_gbs"] = width_bytes / (4 * ns)
    return r


def table(r: dict, machine: str) -> str:
    lines = [f"One core of {machine}, float32, one thread (`python benchmarks/bench_core_limits.py`):", "",
             "| what | figure |", "|---|---:|",
             f"| 512-bit FMA, ns an instruction (16 independent chains) | "
             f"{r['ns_per_fma512']:.3f} |" if r["ns_per_fma512"] else "| 512-bit FMA | (no AVX-512) |",
             f"| 256-bit FMA, ns an instruction | {r['ns_per_fma256']:.3f} |",
             f"| read 1 MiB again and again (in a 2 MiB L2), GB/s | {r['read_l2_gbs']:.1f} |",
             f"| read 1.75 MiB again and again (a batch-1 encoder direction's recurrent matrices), GB/s | "
             f"{r['read_1_75mib_gbs']:.1f} |",
             f"| read 7 MiB again and again (past L2: a decoding step's weights), GB/s | {r['read_7mib_gbs']:.1f} |",
             f"| 1 row x 7 MiB of weights, GB/s of weights (FMA bound {r['fma_bound_rows1_gbs']:.1f}) | "
             f"{r['rows1_7mib_gbs']:.1f} |",
             f"| 4 rows x 7 MiB of weights, GB/s of weights (FMA bound {r['fma_bound_rows4_gbs']:.1f}) | "
             f"{r['rows4_7mib_gbs']:.1f} |",
             f"| the weighing's read of a sentence's source products (0.79 MB, 96 columns at a time), alone, GB/s | "
             f"{r['weigh_hot_gbs']:.1f} |",
             f"| the same right after a 7 MiB read (a step's weights), GB/s | {r['weigh_after_stream_gbs']:.1f} |",
             f"| read 7 MiB with non-temporal prefetches (a hint to keep it out of L2), GB/s | "
             f"{r['read_7mib_nta_gbs']:.1f} |",
             f"| the weighing's read right after that, GB/s | {r['weigh_after_nta_stream_gbs']:.1f} |"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write bench_core_limits.md and .json here")
    a = p.parse_args(argv)
    from common import machine_name, make_out_dir, write_report

    if a.out:   # (before the measurement: an --out that cannot be made failed after it)
        make_out_dir(p, a.out)
    r = measure()
    text = table(r, machine_name(threads=False))
    print(text, end="")
    if a.out:
        write_report(a.out, "bench_core_limits", text, r)
    return r


if __name__ == "__main__":
    main()
