#!/usr/bin/env bash
# Everything a GPU machine is wanted for, in one command: build the extension with its CUDA kernels, run the
# GPU tests (triton and cuda backends against the float64 reference, every dtype; every system on the GPU
# against the CPU reference; the command line with --device cuda), the kernel benchmark in float32 and
# bfloat16 (triton, cuda, eager reference, cuDNN torch.nn.GRU; fwd+bwd and fwd only; peak memory), where a
# layer's time goes (gpu_profile.py: host launches against device work, CUDA-graph replay), and whole systems'
# training throughput on the GPU (bench_train.py --device cuda, paper presets).
#
#   bash benchmarks/gpu_session.sh                      # stages build tests bench; results under $OUT (--help or
#                                                       # -h: this text and the stages)
#   bash benchmarks/gpu_session.sh build tests profile  # only the stages named (any of those on these lines),
#   bash benchmarks/gpu_session.sh bench train          # e.g. to split the work over device calls
#   bash benchmarks/gpu_session.sh build persistent     # the GPU tests with the persistent launches (issue 72),
#                                                       # then they against the per-step ones and cuDNN, strict
#                                                       # fp32 on every side
#   bash benchmarks/gpu_session.sh tests persistent-math  # every GPU test; the same tables in TF32 and in bf16 on
#                                                       # every side (the second call of a session)
#   bash benchmarks/gpu_session.sh persistent-bf16      # bf16 on every side at B = 64, H = 512 and H = 1024 (where
#                                                       # the deep transition reads two T-GRUs' matrices from L2)
#   bash benchmarks/gpu_session.sh persistent-multicast # the grid form in clusters of 2 that read the stage once a
#                                                       # cluster (sm_90a) against the grid form, B = 8, 64, 256
#   bash benchmarks/gpu_session.sh persistent-cluster   # the cluster form (clusters of 16 blocks, each of its own
#                                                       # batch rows) against the grid form and the per-step path,
#                                                       # strict fp32, B = 1, 8, 64, 256
#   bash benchmarks/gpu_session.sh persistent-profile   # eager, device and graphed time of the per-step path and
#                                                       # both persistent forms beside cuDNN, strict fp32
#   bash benchmarks/gpu_session.sh build decode         # beam search on the device against the Python loop
#   bash benchmarks/gpu_session.sh build graphs         # training updates as CUDA graphs: the tests, then graphed
#                                                       # against eager updates in one run (paper presets)
#   bash benchmarks/gpu_session.sh build train-profile  # where a graphed dtmt update's device time goes (kernels)
#   bash benchmarks/gpu_session.sh build unrolled       # the decoder cells' weight gradients once over all steps
#                                                       # on the device (dk.nn.unrolled, cuda backend): the tests,
#                                                       # then against per-step weight gradients, eager and graphed
#   bash benchmarks/gpu_session.sh build attention      # the attention ops' CUDA kernels: their tests, one decoder
#                                                       # step against the reference, a dtmt update with and without
#   bash benchmarks/gpu_session.sh build amp            # bf16 autocast against float32: dev loss after 600 updates
#                                                       # (two seeds each) and speed, dtmt small preset
#   bash benchmarks/gpu_session.sh peers                # OpenNMT-py on the same GPU (issue 73 item 7): decoding the
#   bash benchmarks/gpu_session.sh peers-train          # CPU-trained checkpoints; training speed (each its own call
#                                                       # on a machine already built; see the stage below)
#   bash benchmarks/gpu_session.sh build gemm           # the cuda backend's step GEMMs: its row GEMM, its tiled
#                                                       # GEMM, ATen's mm and cuBLAS called directly, each at
#                                                       # every batch size (why: docs/design/gpu.md, "Step GEMMs",
#                                                       # and "cuBLAS without ATen")
#
# Needs python3 with a CUDA torch, triton, pybind11, ninja, pytest and hypothesis (the device machines' image has them
# all). Files written (at most two folders down): build.log, gpu_tests.log, per dtype
# <dtype>-<math>/bench_cells_cuda.csv and .png (bench), gpu_profile.md (profile), train/bench_train.csv and .png
# (train), gemm_tests.log and gemm_{rows,tiled,cublas,cublas-direct}.md (gemm), persistent.md,
# persistent/bench_persistent.csv, persistent_tests.log, barrier_probe.md and phase_probe.md (persistent),
# persistent_math.md and persistent-math/bench_persistent.csv (persistent-math),
# persistent_envelope.md, persistent_bf16_{512,1024}.md and persistent-bf16-{512,1024}/bench_persistent.csv
# (persistent-bf16), persistent_cluster_tests.log, persistent_cluster.md and persistent-cluster/bench_persistent.csv
# (persistent-cluster), persistent_multicast_tests.log, persistent_multicast.md and
# persistent-multicast/bench_persistent.csv (persistent-multicast),
# persistent_profile_{steps,persistent,persistent-cluster}.md (persistent-profile),
# decode.md, decode/bench_decode.csv, decode_amp.md and decode-amp/bench_decode.csv (decode), graphs_tests.log and
# graphs/bench_train.csv (graphs), math.md, math/bench_train.csv, train_profile.md and .json (train-profile),
# unrolled_tests.log and unrolled/bench_train.csv (unrolled),
# attention_tests.log, attention.md, attention/bench_attention.csv and attention/bench_train.csv (attention),
# amp/quality-dtmt-cuda.json (amp), peers_decode.md (peers) and peers_train.md (peers-train); the tables themselves
# go to stdout. Copy the tables into benchmarks/RESULTS.md with the device line they print. Each stage has a time limit
# (tests 360 s, each kernel benchmark 150 s, profile 120 s, train 240 s, gemm 180 + 4 x 80 s, persistent 180 + 60 + 150
# + 240 s, persistent-math 300 s, persistent-bf16 60 + 2 x 240 s, persistent-cluster 180 + 240 s, persistent-multicast
# 180 + 240 s, persistent-profile 3 x 100 s, decode 300 + 200 s, graphs 150 + 300 s, train-profile 240 + 240 s, unrolled
# 120 + 300 s, attention 90 + 90 + 300 s, amp 480 s, peers 180 s, peers-train 420 s) so that a hang cannot eat the call,
# each cut to what is left of the call's GPU_CALL_S seconds (530 by default, from the script's start, the build's time
# included; a step with under 20 s left is skipped, said and counted a failure): the packing at the end always runs.
# Seen on an H200 (2026-11-30): the machine's start about 30 s, build 106-133 s (106 s for 9.0a at bd1af5e, 2026-12-04),
# every GPU test 175 s, `build persistent` 299 s in all (its GPU tests 105 s), `persistent-math` about 60 s (two modes;
# four now), bench_persistent strict fp32 with both forms at B = 1, 8, 64 42 s, one gpu_profile 30-40 s, decode about 60
# s, the graphed training benchmark 119 s (phase_probe.cu: 250-294 s to compile for sm_90a on 2 busy cores of an AMD
# EPYC here, 2026-12-03, beside the build and the tests; train-profile not yet timed); a warm machine is given back
# after 30 s idle (its build with it), so send the next call at once. A device call is at most 10 minutes, and a session
# has 15 minutes of device time in all, its start included: two or three calls. In this order of the issues (at bd1af5e
# `build persistent`, then `persistent-math` and `tests` ran: RESULTS.md, "Seventh GPU session"): `build
# persistent-cluster` (issue 72: the cluster form in clusters of batch rows, 1 to 8 clusters of 16 blocks, its GPU tests
# and its table at B = 1, 8, 64, 256: whether it becomes the default at B >= 8; it has never run on a GPU with several
# clusters; give it 560 s), then at once `persistent-math persistent-bf16` (TF32 and bf16 on every side, each again with
# the persistent products on FMA, the -fma modes: which products the rule should pick,
# docs/design/persistent_recurrence.md, "Products on tensor cores"; and the H = 1024 goal); then, in the sessions after,
# `build persistent persistent-multicast` (phase_probe.md's tensor-core rows, which split block_mma's time into its
# staging and its MMAs; the grid form in clusters of 2 against the grid form at B = 8, 64, 256: whether it becomes the
# default on sm_90a), `train-profile` (a graphed dtmt update in strict fp32, TF32 and bf16 and where its device time
# goes, issue 73 items 2 and 3), `build persistent-profile`, then `build graphs` (a call each: at most 8 files of $OUT
# come back from a call; issue 72 item 1's device and graphed times; issue 73 item 1), `decode` (with 16-bit decoding:
# item 5's bf16), `unrolled` and `attention` (item 3's pieces, a call each: their caps are 420 and 480 s), `amp`,
# `peers`, `peers-train` (item 7; carry benchmarks/out/gpu-carry). amp, peers and peers-train read data/bible: prepare
# it here and carry it too (the script refuses them without it, before any work); a call's carry is at most 64 MiB in
# all, which gpu-carry (about 58 MB) and the whole of data/bible (13 MB) pass together: with `peers`, carry only
# data/bible/corpus.json and data/bible/test.es, test.en (what it scores with); with `peers-train`,
# benchmarks/out/gpu-carry/wheels and data/bible (about 38 MB). A call without `build` builds first
# where the machine has no build (a fresh one); a call that wrote more than 8 files packs them into
# $OUT/gpu_session_files.tgz (8 come back): only the files this call wrote, files already in $OUT staying as they are
# (an archive of an earlier call is not replaced: the new one is gpu_session_files-2.tgz, -3, ...).
set -uo pipefail
KNOWN="build tests bench profile train graphs train-profile unrolled attention amp gemm persistent persistent-math \
persistent-cluster persistent-multicast persistent-profile persistent-bf16 decode peers peers-train"
if [[ " $* " == *" --help "* || " $* " == *" -h "* ]]; then   # the comment above, the usage, without its #s
  sed -n '2,/^set -uo pipefail/{/^set /d;s/^# \{0,1\}//;p;}' "$0"
  echo "The stages: $KNOWN"
  exit 0
fi
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-benchmarks/out/gpu}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
status=0
STAGES=${*:-build tests bench}
want() { [[ " $STAGES " == *" $1 "* ]]; }
# the call's own deadline (a device call is killed at 10 minutes, before the packing at the end: every file of the
# call lost): each step's time limit is cut to what is left of GPU_CALL_S (default 530 s from the script's start, the
# build's time included), and a step with less than 20 s left is skipped, said, and counts as a failure
CALL_S=${GPU_CALL_S:-530}
limit() {   # limit SECONDS COMMAND...: `timeout`, capped at the call's time left
  local cap=$1 left=$((CALL_S - SECONDS))
  shift
  if ((left < 20)); then
    echo "gpu_session.sh: skipped, ${left} s left of the call's ${CALL_S} s (GPU_CALL_S): $*" >&2
    return 124
  fi
  ((cap > left)) && cap=$left
  timeout "$cap" "$@"
}
# a misspelt stage would otherwise run nothing and exit 0 (after the build, when asked for): refuse it before the GPU
for stage in $STAGES; do
  [[ " $KNOWN " == *" $stage "* ]] || { echo "gpu_session.sh: no stage '$stage' (the stages: $KNOWN)" >&2; exit 2; }
done
# amp and the peers read the prepared Bible corpus, which the device machine cannot prepare (no SWORD modules, no
# network) and which git ignores: it must travel in the call's carry, prepared here first
if { want amp || want peers || want peers-train; } && [ ! -f data/bible/corpus.json ]; then
  echo "gpu_session.sh: amp, peers and peers-train read data/bible: prepare it here (dtmt prepare bible --out" \
    "data/bible) and name data/bible in the device call's carry" >&2
  exit 2
fi
mkdir -p "$OUT" || exit 1
# what $OUT holds before this call (each file's modification time, size, inode and path): the packing at the end takes
# only the files this call wrote or replaced, never one it found there
scratch=$(mktemp -d) || exit 1
trap 'rm -rf "$scratch"' EXIT
found_in_out() { find "$OUT" -mindepth 1 -type "$1" -printf "$2" | LC_ALL=C sort; }
found_in_out f '%T@ %s %i %P\n' >"$scratch/files_before"
found_in_out d '%P\n' >"$scratch/dirs_before"

echo "== device"
nvidia-smi -L || true
# (one line where there is no GPU or no triton, not torch's AssertionError traceback)
"$PY" -c "
import sys
import torch
if not torch.cuda.is_available():
    sys.exit('gpu_session.sh: no CUDA device here (torch ' + torch.__version__ + ', CUDA ' + str(torch.version.cuda)
             + '): run it on a machine with a GPU')
try:
    import triton
except ImportError:
    sys.exit('gpu_session.sh: triton is not installed for ' + sys.executable)
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__,
      torch.cuda.get_device_name(0))" || exit 1
# compile the CUDA sources for this device only (a fraction of the build time of torch's default list); on compute
# capability 9.0 its arch-specific code, 9.0a (the bulk copies' multicast of the stage read once a cluster, setup.py's
# DTMT_SM90A; docs/design/persistent_recurrence.md, "The stage read once a cluster")
: "${TORCH_CUDA_ARCH_LIST:=$("$PY" -c "import torch; c = torch.cuda.get_device_capability(0); \
print('%d.%d%s' % (c[0], c[1], 'a' if c == (9, 0) else ''))")}"
export TORCH_CUDA_ARCH_LIST
nvcc=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
probes=$(mktemp -d)
if want persistent; then
  # the persistent stage's two probes are standalone programs: they compile beside the build and the tests (an nvcc
  # each, minutes for phase_probe.cu for sm_90a; the build leaves most of the device machine's cores idle), not
  # after them
  for probe in barrier_probe phase_probe; do
    flags=(-std=c++17 -O3 -arch=sm_"${TORCH_CUDA_ARCH_LIST//./}" -Icsrc)
    [ "$probe" = phase_probe ] && flags+=(--use_fast_math -DDTMT_PERSISTENT_PHASES)
    [[ "$TORCH_CUDA_ARCH_LIST" == 9.0a ]] && flags+=(-DDTMT_SM90A)
    "$nvcc" "${flags[@]}" "benchmarks/$probe.cu" -o "$probes/$probe" >"$probes/$probe.log" 2>&1 &
    echo $! >"$probes/$probe.pid"
  done
fi
# run_probe NAME SECONDS: wait for its compile, then run it (its output to stdout and $OUT/NAME.md)
run_probe() {
  if wait "$(cat "$probes/$1.pid")"; then
    limit "$2" "$probes/$1" | tee "$OUT/$1.md" || status=1
  else
    echo "$1.cu did not compile:"; tail -20 "$probes/$1.log"; status=1
  fi
}

# persistent_form FORM BATCHES: the GPU kernel tests with DTMT_CUDA_RECURRENCE=persistent-FORM asked for, then the
# per-step path, the grid form and FORM in one run (bench_persistent.py), strict fp32 on every side, at BATCHES
persistent_form() {
  local form=$1 batches=$2
  echo "== GPU kernel tests with DTMT_CUDA_RECURRENCE=persistent-$form"
  DTMT_CUDA_RECURRENCE=persistent-$form limit 180 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_triton.py 2>&1 | tee "$OUT/persistent_${form}_tests.log" | tail -5 || status=1
  echo "== bench_persistent --forms grid $form (strict fp32 on every side, B = $batches)"
  # (the batches as words)
  # shellcheck disable=SC2086
  limit 240 "$PY" benchmarks/bench_persistent.py --math strict --forms grid "$form" --B $batches \
    --out "$OUT/persistent-$form" 2>&1 | tee "$OUT/persistent_$form.md" || status=1
}

# whether the extension here has both GPU backends (it prints them; fails naming what is missing)
gpu_backends() {
  "$PY" -c "import dtmt_kernels as dk; b = dk.available_backends(); print('backends:', b); \
assert {'triton', 'cuda'} <= set(b), 'a GPU backend is missing (see build.log)'"
}
# a call without `build` on a fresh machine (a warm one goes back after 30 s idle, its build with it) builds first
if ! want build && ! gpu_backends >/dev/null 2>&1; then
  echo "== no build with the GPU backends here: building first"
  STAGES="build $STAGES"
fi
if want build; then
  echo "== build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, $MAX_JOBS jobs)"
  start=$SECONDS
  if ! "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"
    exit 1
  fi
  echo "built in $((SECONDS - start)) s"
  # (kept beside the build, which a warm machine keeps for the calls after: gemm reads what it says of cuBLAS, and a
  # call without `build` finds no build.log in its own $OUT)
  mkdir -p build && cp "$OUT/build.log" build/gpu_session_build.log
  # the host compilers of the C++ sources (CXX, else python's) and of the CUDA unit (nvcc's: CC where set, torch passes
  # it as -ccbin; else the g++ on PATH), and whether the extension holds its own copies of libstdc++'s stream code (on
  # the image of 2026-11-30 a number streamed into a message from the CUDA unit crashed inside libstdc++:
  # docs/design/gpu.md, "Messages from the CUDA unit")
  cxx=${CXX:-$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("CXX").split()[0])')}
  ccbin=${CC:-$(command -v g++)}
  echo "host compilers: the C++ sources' $cxx $($cxx -dumpfullversion 2>&1), nvcc's $ccbin" \
    "$($ccbin -dumpfullversion 2>&1); libstdc++ stream inserters defined in the extension:" \
    "$(nm -C --defined-only dtmt_kernels/_C*.so 2>/dev/null | grep -c 'std::basic_ostream<.*>::_M_insert<')"
fi
# both GPU backends must be there: otherwise the tests below would check only one and still pass
gpu_backends || exit 1

# deterministic mode (tests/conftest.py) with cuBLAS: older torch wants a fixed workspace
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
if want tests; then
  echo "== GPU tests"
  limit 360 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # a skip on a GPU machine is a failure, but for the tests of a recurrence this stage does not ask for (the
  # persistent stages run them under DTMT_CUDA_RECURRENCE)
  if grep "^SKIPPED" "$OUT/gpu_tests.log" | grep -v "DTMT_CUDA_RECURRENCE=persistent"; then
    echo "GPU tests were skipped on a GPU machine"; status=1
  fi
fi

# every math mode named (issue 72 item 1): strict fp32 on every side, torch's fast mode (TF32), bf16
want bench && for mode in float32:strict float32:tf32 bfloat16:strict; do
  dtype=${mode%%:*}; math=${mode##*:}
  echo "== bench_cells --device cuda --dtype $dtype --math $math"
  limit 150 "$PY" benchmarks/bench_cells.py --device cuda --dtype "$dtype" --math "$math" --T 50 \
    --BH 1x512 8x512 64x512 --depths 1 4 --repeat 10 --out "$OUT/$dtype-$math" || status=1
done
if want profile; then
  echo "== gpu_profile (float32)"
  limit 120 "$PY" benchmarks/gpu_profile.py 2>&1 | tee "$OUT/gpu_profile.md" || status=1
fi
if want train; then
  echo "== bench_train --device cuda --preset paper"
  limit 240 "$PY" benchmarks/bench_train.py --device cuda --preset paper --max-tokens 4000 --steps 6 \
    --systems dtmt nematus rnnsearch-atr transformer --fused cuda triton --out "$OUT/train" || status=1
fi
if want graphs; then
  # issue 73 item 1: updates replayed as CUDA graphs (dtmt train --cuda-graphs), first against eager updates (the
  # test), then their throughput against eager in one run (paper presets; each bucket eager once, captured once,
  # before the timed updates)
  echo "== GPU tests of the graphed updates"
  limit 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_graphs.py -s 2>&1 \
    | tee "$OUT/graphs_tests.log" | tail -8 || status=1
  echo "== bench_train --device cuda --preset paper --graphs off on"
  limit 300 "$PY" benchmarks/bench_train.py --device cuda --preset paper --max-tokens 4000 --steps 8 \
    --systems dtmt rnnsearch-atr transformer --fused cuda --graphs off on --out "$OUT/graphs" || status=1
fi
if want train-profile; then
  # issue 73 items 2, 3 and 5: a graphed dtmt update's throughput in each math mode (strict fp32, TF32, bf16 autocast
  # as `dtmt train --amp bf16`; the ratios in one run), then where its device time goes in strict fp32 (paper preset,
  # 4,000 tokens a batch): the kernels with the most device time, and the device's busy share of the wall time
  echo "== bench_train --systems dtmt --fused cuda --device cuda --preset paper --graphs on --math strict tf32 bf16"
  limit 240 "$PY" benchmarks/bench_train.py --systems dtmt --fused cuda --device cuda --preset paper \
    --max-tokens 4000 --steps 4 --graphs on --math strict tf32 bf16 --out "$OUT/math" 2>&1 | tee "$OUT/math.md" \
    | tail -8 || status=1
  echo "== bench_train --one dtmt cuda --device cuda --preset paper --graphs on --profile 30"
  limit 240 "$PY" benchmarks/bench_train.py --one dtmt cuda --device cuda --preset paper --max-tokens 4000 \
    --steps 4 --graphs on --profile 30 > "$OUT/train_profile.json" 2> "$OUT/train_profile.md" || status=1
  grep -A 33 "^| kernel" "$OUT/train_profile.md"; cat "$OUT/train_profile.json"
fi
if want unrolled; then
  # issue 73 item 3: the decoder cells' weight gradients once over all steps on the device (dk.nn.unrolled with the
  # cuda backend: transition_backward with weight_grads=False), first against the step-by-step path (the test),
  # then cuda+unrolled against cuda in one run, eager and graphed (dtmt, paper preset)
  echo "== GPU tests of the unrolled cells"
  limit 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_unrolled.py 2>&1 \
    | tee "$OUT/unrolled_tests.log" | tail -5 || status=1
  echo "== bench_train --device cuda --preset paper --fused cuda cuda+unrolled --graphs off on"
  limit 300 "$PY" benchmarks/bench_train.py --device cuda --preset paper --max-tokens 4000 --steps 8 \
    --systems dtmt --fused cuda cuda+unrolled --graphs off on --out "$OUT/unrolled" || status=1
fi
if want attention; then
  # issue 73 item 3: the attention ops' CUDA kernels (csrc/attention_cuda.cu; not yet the default): their GPU tests
  # against the float64 reference and in a captured graph, one decoder step against the reference's PyTorch ops,
  # then a dtmt update with them against without, eager and graphed (strict fp32)
  echo "== GPU tests of the attention kernels"
  limit 90 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_kernel.py 2>&1 \
    | tee "$OUT/attention_tests.log" | tail -5 || status=1
  echo "== bench_attention --device cuda"
  limit 90 "$PY" benchmarks/bench_attention.py --device cuda --out "$OUT/attention" | tee "$OUT/attention.md" \
    || status=1
  echo "== bench_train --device cuda --preset paper --fused cuda cuda+attention --graphs off on"
  limit 300 "$PY" benchmarks/bench_train.py --device cuda --preset paper --max-tokens 4000 --steps 8 \
    --systems dtmt --fused cuda cuda+attention --graphs off on --out "$OUT/attention" || status=1
fi
if want amp; then
  # issue 73 item 2: may bfloat16 autocast be the default on a GPU? the dev loss after 600 updates, float32 against
  # bf16, two seeds each (the spread between seeds is the noise), and the speed of each, both eager (float32 alone
  # replays its updates as CUDA graphs by default: the speeds would compare a graph with eager)
  echo "== bench_amp --quality --device cuda"
  limit 480 "$PY" benchmarks/bench_amp.py --quality --device cuda --steps 600 --seeds 1 2 \
    --out "$OUT/amp" --runs /tmp/dtmt-amp-runs --train-args=--no-cuda-graphs || status=1
fi
if want gemm; then
  # cublas-direct: cublasGemmEx on torch's handle, built where the toolkit has cuBLAS's headers (else build.log says
  # so, and the value would only run the default GEMMs: skipped); cublas: ATen's mm. (pipefail, set above: a
  # failed command before `| tee` counts)
  gemms="rows tiled cublas cublas-direct"
  if grep -h -m1 "built without the step GEMMs' direct cuBLAS" "$OUT/build.log" build/gpu_session_build.log \
    2>/dev/null; then
    gemms="rows tiled cublas"
    echo "   (so no cublas-direct tests or profile)"
  else
    echo "== GPU kernel tests with direct cuBLAS calls for every step GEMM (DTMT_CUDA_STEP_GEMM=cublas-direct)"
    DTMT_CUDA_STEP_GEMM=cublas-direct limit 180 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_triton.py 2>&1 | tee "$OUT/gemm_tests.log" | tail -5 || status=1
  fi
  for gemm in $gemms; do
    echo "== gpu_profile, cuda backend, DTMT_CUDA_STEP_GEMM=$gemm"
    DTMT_CUDA_STEP_GEMM=$gemm limit 80 "$PY" benchmarks/gpu_profile.py --backends cuda --B 1 8 16 64 \
      --kernels 3 2>"$probes/gemm.err" | tee "$OUT/gemm_$gemm.md" || { status=1; tail -20 "$probes/gemm.err"; }
  done
fi
if want persistent; then
  # issue 72: the GPU kernel tests with every recurrence persistent (fp32 strict and TF32, bf16 and fp16 products on
  # tensor cores), then the persistent launches (one cooperative launch per layer, forward and backward) against the
  # per-step ones and cuDNN, in strict fp32 on every side (TF32 and bf16: the persistent-math stage, which fits the
  # call after this one; here they ran past the call's 560 s at 4dec932)
  echo "== GPU kernel tests with DTMT_CUDA_RECURRENCE=persistent"
  DTMT_CUDA_RECURRENCE=persistent limit 180 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_triton.py \
    2>&1 | tee "$OUT/persistent_tests.log" | tail -5 || status=1
  echo "== the barrier alone (benchmarks/barrier_probe.cu: grid and cluster form, no work between barriers)"
  run_probe barrier_probe 60
  echo "== where a persistent step's time goes (benchmarks/phase_probe.cu: the kernels with their phase clock)"
  run_probe phase_probe 150
  echo "== bench_persistent (DTMT_CUDA_RECURRENCE=steps vs persistent; strict fp32 on every side)"
  limit 240 "$PY" benchmarks/bench_persistent.py --math strict --out "$OUT/persistent" 2>&1 \
    | tee "$OUT/persistent.md" || status=1
fi
if want persistent-math; then
  # issue 72 item 1: the same tables in torch's fast mode (TF32 where torch allows it: cuBLAS, cuDNN and our products
  # on tensor cores) and in bf16 storage on every side, each against cuDNN in the same mode; and each again with the
  # persistent products on FMA (-fma: DTMT_CUDA_PRODUCTS=fma), which the phase probe found faster at H = 512, B = 64:
  # the rule's choice of products (docs/design/persistent_recurrence.md, "Products on tensor cores")
  echo "== bench_persistent --math tf32 tf32-fma bf16 bf16-fma (DTMT_CUDA_RECURRENCE=steps vs persistent)"
  limit 300 "$PY" benchmarks/bench_persistent.py --math tf32 tf32-fma bf16 bf16-fma --B 1 8 64 \
    --out "$OUT/persistent-math" 2>&1 | tee "$OUT/persistent_math.md" || status=1
fi
if want persistent-cluster; then
  # issue 72: the cluster form of the persistent launches (thread-block clusters of 16 blocks, each cluster the whole
  # layer for its own batch rows, the cluster's barrier instead of the grid's; Hopper; docs/design/
  # persistent_recurrence.md, "One cluster" and "Clusters of batch rows"; a layer that does not fit a cluster takes
  # the grid form): one cluster at B = 1, 8 clusters of B / 8 rows above, where the grid form's stage is largest
  persistent_form cluster "1 8 64 256"
fi
if want persistent-multicast; then
  # issue 72: the grid form in thread-block clusters of 2 whose blocks read the products' stage from L2 once a cluster
  # (bulk copies multicast: code for sm_90a, the build's TORCH_CUDA_ARCH_LIST=9.0a on an H100 / H200;
  # docs/design/persistent_recurrence.md, "The stage read once a cluster"), at the batch sizes where the stage is
  # largest
  persistent_form multicast "8 64 256"
fi
if want persistent-profile; then
  # issue 72 item 1: eager, device (kernel) and graph-replayed time of the cuda backend's per-step path and both
  # persistent forms, beside cuDNN's GRU, strict fp32 on every side (gpu_profile.py --math strict)
  for rec in steps persistent persistent-cluster; do
    echo "== gpu_profile, cuda backend, DTMT_CUDA_RECURRENCE=$rec, strict fp32"
    DTMT_CUDA_RECURRENCE=$rec limit 100 "$PY" benchmarks/gpu_profile.py --backends cuda --math strict 2>&1 \
      | tee "$OUT/persistent_profile_$rec.md" || status=1
  done
fi
if want persistent-bf16; then
  # issue 72: the deep transition at H = 1024 in bf16 within 2.5x its H = 512 time. At 1024 its matrices outgrow the
  # shared memory of the whole GPU, and the plan reads the two top T-GRUs' from L2 (docs/design/
  # persistent_recurrence.md, "Past shared memory: the L2"): the envelope on this device first, then both sizes
  echo "== the persistent envelope on this device"
  limit 60 "$PY" benchmarks/bench_persistent.py --envelope --B 64 2>&1 | tee "$OUT/persistent_envelope.md" || status=1
  for H in 512 1024; do   # (and the products on FMA: bf16-fma)
    echo "== bench_persistent --math bf16 bf16-fma --B 64 --H $H"
    limit 240 "$PY" benchmarks/bench_persistent.py --math bf16 bf16-fma --B 64 --H "$H" \
      --out "$OUT/persistent-bf16-$H" 2>&1 | tee "$OUT/persistent_bf16_$H.md" || status=1
  done
fi
if want decode; then
  # issue 73 item 4: beam search on the device (its bookkeeping on the GPU; and its steps a CUDA graph where the state
  # keeps its shapes) against the Python loop (three reads a step), all in this run; float32 with torch's default
  # for matmul (TF32 off)
  echo "== bench_decode --device cuda --loops host device graph (beam 4, batches of 1 and 32)"
  limit 300 "$PY" benchmarks/bench_decode.py --device cuda --loops host device graph --systems dtmt rnnsearch-atr \
    nematus transformer --no-match --beams 4 --sentences 32 --batch-size 32 --repeat 2 --out "$OUT/decode" \
    2>&1 | tee "$OUT/decode.md" || status=1
  # issue 73 item 5's bf16 (and fp16) figures: `dtmt translate --amp` (a 16-bit copy under autocast) against float32,
  # the graph loop, every model in each precision in the same run
  echo "== bench_decode --device cuda --loops graph --amp off bf16 fp16 (beam 4, batches of 1 and 32)"
  limit 200 "$PY" benchmarks/bench_decode.py --device cuda --loops graph --amp off bf16 fp16 --systems dtmt \
    rnnsearch-atr nematus transformer --no-match --beams 4 --sentences 32 --batch-size 32 --repeat 2 \
    --out "$OUT/decode-amp" 2>&1 | tee "$OUT/decode_amp.md" || status=1
fi
if want peers || want peers-train; then
  # issue 73 item 7: OpenNMT-py on the same GPU. The machine has no network: OpenNMT-py's wheels and the checkpoints
  # trained on the CPU by the equal-time benchmark travel in benchmarks/out/gpu-carry, gathered beforehand on a
  # machine with one and named in the device call's carry:
  #   python benchmarks/bench_peers.py --carry benchmarks/out/gpu-carry --out benchmarks/out/peers-wall \
  #     --systems dtmt onmt-lstm --checkpoints best --budget 30m --threads 2 --sequential
  # CTranslate2 4.8.5 (the newest wheel) is built for CUDA 12's cuBLAS, which the CUDA 13 image lacks and which is
  # too large to carry: it stays a CPU comparison (docs/design/gpu.md, "The peers on the GPU").
  carry=benchmarks/out/gpu-carry
  peerpath=/tmp/peer-site
  if ! ls "$carry"/wheels/*.whl >/dev/null 2>&1; then
    echo "== peers: no wheels in $carry (gather them first, see above, and carry $carry)"
    status=1
  elif "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$peerpath" \
      "$carry"/wheels/*.whl; then
    "$PY" -c "import spacy, fasttext" 2>/dev/null || peerpath="$peerpath:$PWD/benchmarks/peers/offline"
    if want peers; then
      echo "== peers: decoding the Bible test set on the GPU with the CPU-trained checkpoints (lowest dev loss; beam"
      echo "   4, batches of 64 sentences; each translator's process from launch to exit; strict fp32 on both sides)"
      PYTHONPATH="$peerpath${PYTHONPATH:+:$PYTHONPATH}" limit 180 "$PY" benchmarks/bench_peers.py --no-train \
        --device cuda --checkpoints best --decode-batch 64s --systems dtmt onmt-lstm --budget 30m --threads 2 \
        --sequential --peer-python "$PY" --out "$carry/peers" 2>&1 | tee "$OUT/peers_decode.md" || status=1
    fi
    if want peers-train; then
      echo "== peers-train: dtmt's paper preset against OpenNMT-py's LSTM of its parameter count on the GPU, the same"
      echo "   batches of tokens, 120 s of wall time from each launch, one after the other, strict fp32 on both sides"
      PYTHONPATH="$peerpath${PYTHONPATH:+:$PYTHONPATH}" limit 420 "$PY" benchmarks/bench_peers.py --device cuda \
        --preset paper --budget 120s --sequential --systems dtmt onmt-lstm --onmt-size match \
        --valid-every 1000000 --no-decode --peer-python "$PY" --out /tmp/dtmt-peers-gpu --overwrite 2>&1 \
        | tee "$OUT/peers_train.md" || status=1
    fi
  else
    status=1
  fi
fi
rm -rf "$probes"
# at most 8 files of $OUT come back from a device call: where this call wrote more, they travel as one archive (untar
# it here), the tables being on stdout as well. Only this call's files (new, or changed since the listing above) are
# packed and removed: files and folders that were in $OUT before stay as they were (a pre-existing folder had gone
# into the archive and been deleted)
found_in_out f '%T@ %s %i %P\n' | LC_ALL=C comm -13 "$scratch/files_before" - | cut -d' ' -f4- >"$scratch/written"
count=$(wc -l <"$scratch/written")
if [ "$count" -gt 8 ]; then
  archive=gpu_session_files.tgz n=1
  while [ -e "$OUT/$archive" ]; do n=$((n + 1)); archive=gpu_session_files-$n.tgz; done
  packed=$(mktemp)
  # (packing failed: the files stay as they are, 8 of them come back, the call fails; the archive is made in $OUT
  # before any file goes: only $OUT comes back, so a copy elsewhere would be lost with the machine)
  if ! tar -czf "$packed" -C "$OUT" --verbatim-files-from -T "$scratch/written"; then
    rm -f "$packed"
    echo "== $count files written in $OUT: packing them failed, they stay unpacked (only 8 come back)" >&2
    status=1
  elif mv "$packed" "$OUT/$archive" && (cd "$OUT" && xargs -d '\n' rm -f -- <"$scratch/written"); then
    # the folders this call made and left empty go too (deepest first); the others stay
    found_in_out d '%P\n' | LC_ALL=C comm -13 "$scratch/dirs_before" - | LC_ALL=C sort -r \
      | (cd "$OUT" && xargs -r -d '\n' rmdir --ignore-fail-on-non-empty --)
    echo "== $count files written in $OUT: packed into $OUT/$archive (8 files come back from a device call)"
  else
    rm -f "$packed"
    echo "== $count files written in $OUT: packing them failed part-way; what is left in $OUT comes back (8 files)" >&2
    status=1
  fi
fi
exit $status
