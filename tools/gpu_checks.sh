#!/usr/bin/env bash
# The GPU session's checks in one command, each stage capped in seconds so that one stuck
# stage leaves the others their time; logs and JSON under $OUT (default ./gpu_out).
#
#     tools/gpu_checks.sh [STAGE ...]     # stages: env kernels fuse branches generate decode1
#                                         # fused decode64 quant cmdbuf qmm sweep hf (default:
#                                         # all)
#
# - kernels: the native kernel tier (`pytest -m gpu tests/test_kernel_*.py`, 8 workers);
# - fuse: 1 stream at decode_steps 1 and 8 with the projections that share an input fused
#   (q | k | v, gate | up: KernelConfig.fuse_projections, the GPU default since session 24)
#   and not, with a trace each (device busy);
# - branches: 1 stream at decode_steps 1 and 8 with the sampler's branches decided on device
#   (lax.cond: XLA:GPU waits on the host at each) and on the host (jaxserve.sample.plan, the
#   GPU default since session 23), with a trace each (device busy);
# - generate: `jaxserve bench generate` on dummy Llama-3-8B, 1 and 64 streams, decode_steps
#   1 and 8, with a trace (device busy);
# - decode1: generate's one stream alone, decode_steps auto (8 on a GPU) and 1, traced (issue
#   28's 200 tok/s and 90% busy); decode64: its 64 streams at decode_steps auto, untraced
#   (issue 28's 5,000 tok/s);
# - fused: one stream at decode_steps 1 with a one-token decode step in one program and in
#   two (CompilationConfig.fused_decode on / off: the sampler's dispatch of its own), each
#   traced (issue 28 item 5: device busy at decode_steps 1);
# - quant: 1 stream at decode_steps 8 with QUANT_FORMATS (default none,int8,fp8_e4m3) weights
#   (fused before they are quantised on a GPU), each with every matmul_impl of QUANT_IMPLS
#   (default auto: XLA's dot of the widened weight for per-channel scales; pallas /
#   pallas_mosaic: the Triton / Mosaic kernels; pallas_gemv: the Triton kernel with its
#   CUDA-core GEMV at one row): end-to-end decode of the quantised matmuls;
# - cmdbuf: the same cases at decode_steps 1 with XLA's command buffers (CUDA graphs) off and
#   as XLA sets them (CompilationConfig.xla_compiler_options): decided by measurement (with
#   the sampler's branches decided on the host no program has a conditional to put in one);
# - qmm: tools.bench_quantized_matmul at M = 1 and 64;
# - sweep: tools.bench_quantized_matmul --sweep at M = 1, int8, the fused model's shapes
#   (q|k|v 4096x6144, o, gate|up 4096x28672, down): the kernels' tiles and the CUDA-core
#   GEMV variants against XLA;
# - hf: HF transformers' eager bf16 generate on the same shapes (HF_CASES, default both).
# generate's cases and decode_steps: GEN_CASES (default both), GEN_STEPS (default 8,1).
# Caps: KERNELS_S, FUSE_S, BRANCHES_S, GENERATE_S, DECODE1_S, DECODE64_S, QUANT_S, CMDBUF_S,
# QMM_S, SWEEP_S, HF_S; DEADLINE_S (default 3600): no stage runs past this many seconds from
# the start (each cap is cut to what is left, a stage with under 20 s left is skipped), so one
# device call ends inside its limit with the stages in the order given. BANDWIDTH_GB_S: the
# read bandwidth generate's bounds use (default: measured in each process; e.g. 4300 on an
# H200, its copy rate). Needs a Python where
# `import jaxserve` works (the repository on PYTHONPATH, its dependencies installed or
# carried as wheels). Checked on CPU by tests/test_gpu_checks_script.py: every stage run with
# a recorder in place of Python, each command line parsed by its own tool (a flag renamed
# since the last GPU run fails that test here, not a stage on the lent machine).
# Session 22's run on an H100 (PERFORMANCE.md, "The GPU run of session 22"): env ~15 s,
# kernels ~90 s, generate ~190 s for two decode_steps values, qmm ~75 s for two shapes with
# single-call timing, hf ~85 s; cmdbuf (three engines) and qmm (four shapes, 16 copies) not
# yet run: their caps are estimates. Session 24's (H100): env 3 s, branches 173 s (four
# engines, one case each, traced; fuse is the same size), cmdbuf over 190 s (two engines,
# both cases), qmm 60 s (four shapes, M 1 and 64, three implementations), the 64-stream
# case at decode_steps 8 and 1 without a trace 192 s. Session 27's (H200): decode1 86 s,
# decode64 80 s, sweep 64 s, quant 154 s (four engines), kernels 71 s, hf 41 s (one case):
# 498 s for `DEADLINE_S=545 ... env decode1 decode64 sweep quant kernels hf`. A lease of
# 15 minutes holds one call of ~9.5 minutes after the machine's start. Session 30 added
# seven CUDA-core GEMV variants to the sweep (SWEEP in tools/bench_quantized_matmul): ~1.5x
# its variants, so its cap went from 150 to 220 s.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T0=$(date +%s)
all_stages="env kernels fuse branches generate decode1 fused decode64 quant cmdbuf qmm sweep hf"
stages=${*:-$all_stages}
say() { echo; echo "=== $1 (t=$(( $(date +%s) - T0 ))s)"; }
declare -A DEFAULT_CAP=([env]=30 [kernels]=150 [fuse]=240 [branches]=300 [generate]=200
  [decode1]=150 [fused]=150 [decode64]=130 [quant]=200 [cmdbuf]=300 [qmm]=180 [sweep]=220 [hf]=100)
# cap SECONDS: the stage's own cap cut to what DEADLINE_S leaves (0: skip the stage)
cap() { local left=$(( ${DEADLINE_S:-3600} - ($(date +%s) - T0) - 5 ))
        if [ "$left" -lt 20 ]; then echo 0
        elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi; }
# keep NAME DIR: copy the largest perfetto trace under DIR to $OUT/NAME if it is under 16 MB
keep() { local f; f=$(ls -S "$2"/plugins/profile/*/*perfetto_trace.json.gz 2>/dev/null | head -1)
         [ -n "$f" ] && [ "$(stat -c %s "$f")" -lt 16000000 ] && cp "$f" "$OUT/$1"; }
cases=1x128x256,64x512x256
BW=${BANDWIDTH_GB_S:+--bandwidth-gb-s $BANDWIDTH_GB_S}
for stage in $stages; do
  say "$stage"
  var=${stage^^}_S
  c=$(cap "${!var:-${DEFAULT_CAP[$stage]:-600}}")
  if [ "$c" = 0 ]; then echo "skipped: DEADLINE_S reached"; continue; fi
  case $stage in
    env)
      nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
      $PY -c "import sys, jax; print(sys.version.split()[0], jax.__version__, jax.devices(),
getattr(jax.devices()[0], 'compute_capability', None))" ;;
    kernels)
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "$c" $PY -m pytest -m gpu \
        tests/test_kernel_*.py -n 8 -q -rfE --tb=short -p no:cacheprovider > "$OUT/kernels.log" 2>&1
      echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kernels.log" | cut -c1-200 | head -40 ;;
    fuse)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 5 "$c" $PY -m jaxserve.cli.main \
        bench generate --config llama3_8b $BW --cases 1x128x256 --decode-steps 1,8 \
        --fuse-projections on,off --trace /tmp/trace_fu --json "$OUT/fuse.json" 2>&1 \
        | grep -v "compiling step" | tee "$OUT/fuse.log" | tail -6
      keep trace_1x128x256_ds1_fused.json.gz /tmp/trace_fu/1x128x256-1-on ;;
    branches)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 5 "$c" $PY -m jaxserve.cli.main \
        bench generate --config llama3_8b $BW --cases 1x128x256 --decode-steps 1,8 \
        --branches host,device --trace /tmp/trace_br --json "$OUT/branches.json" 2>&1 \
        | grep -v "compiling step" | tee "$OUT/branches.log" | tail -6
      keep trace_1x128x256_ds1_host.json.gz /tmp/trace_br/1x128x256-1-host ;;
    generate)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 5 "$c" $PY -m jaxserve.cli.main \
        bench generate --config llama3_8b $BW --cases ${GEN_CASES:-$cases} \
        --decode-steps ${GEN_STEPS:-8,1} --trace /tmp/trace \
        --json "$OUT/generate.json" 2>&1 | grep -v "compiling step" | tee "$OUT/generate.log" | tail -8
      keep trace_1x128x256_ds1.json.gz /tmp/trace/1x128x256-1 ;;
    decode1)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 5 "$c" $PY -m jaxserve.cli.main \
        bench generate --config llama3_8b $BW --cases 1x128x256 --decode-steps auto,1 \
        --trace /tmp/trace_d1 --json "$OUT/decode1.json" 2>&1 | grep -v "compiling step" \
        | tee "$OUT/decode1.log" | tail -4
      keep trace_1x128x256_auto.json.gz /tmp/trace_d1/1x128x256-auto
      keep trace_1x128x256_ds1.json.gz /tmp/trace_d1/1x128x256-1 ;;
    fused)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 5 "$c" $PY -m jaxserve.cli.main \
        bench generate --config llama3_8b $BW --cases 1x128x256 --decode-steps 1 \
        --fused-decode on,off --trace /tmp/trace_fd --json "$OUT/fused.json" 2>&1 \
        | grep -v "compiling step" | tee "$OUT/fused.log" | tail -4
      keep trace_1x128x256_ds1_whole.json.gz /tmp/trace_fd/1x128x256-1-on ;;
    decode64)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 5 "$c" $PY -m jaxserve.cli.main \
        bench generate --config llama3_8b $BW --cases 64x512x256 --decode-steps auto \
        --json "$OUT/decode64.json" 2>&1 | grep -v "compiling step" \
        | tee "$OUT/decode64.log" | tail -3 ;;
    quant)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 5 "$c" $PY -m jaxserve.cli.main \
        bench generate --config llama3_8b $BW --cases 1x128x256 --decode-steps 8 \
        --weight-quant "${QUANT_FORMATS:-none,int8,fp8_e4m3}" --matmul-impl "${QUANT_IMPLS:-auto}" \
        --json "$OUT/quant.json" 2>&1 | grep -v "compiling step" | tee "$OUT/quant.log" | tail -7 ;;
    sweep)
      timeout -k 5 "$c" $PY -m tools.bench_quantized_matmul --m 1 --repeats 7 --formats int8 \
        --shapes 4096x28672 14336x4096 4096x6144 4096x4096 --impls xla_bf16 xla pallas \
        pallas_mosaic --sweep --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log" | tail -60 ;;
    cmdbuf)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout -k 5 "$c" $PY -m jaxserve.cli.main \
        bench generate --config llama3_8b $BW --cases $cases --decode-steps 1 \
        --xla-compiler-options '{"xla_gpu_enable_command_buffer": ""}' '{}' \
        --json "$OUT/cmdbuf.json" 2>&1 | grep -v "compiling step" | tee "$OUT/cmdbuf.log" | tail -8 ;;
    qmm)
      timeout -k 5 "$c" $PY -m tools.bench_quantized_matmul --m 1 64 --repeats 10 \
        --shapes 4096x14336 14336x4096 4096x4096 4096x1024 --impls xla_bf16 pallas pallas_mosaic \
        --json "$OUT/qmm.json" 2>&1 | tee "$OUT/qmm.log" | tail -45 ;;
    hf)
      timeout -k 5 "$c" $PY -c "
from jaxserve.config import load_config
from jaxserve.bench.generate import hf_tok_s
m = load_config('llama3_8b').model
for case in [tuple(map(int, c.split('x'))) for c in '${HF_CASES:-$cases}'.split(',')]:
    print(case, 'HF eager bf16 tok/s', hf_tok_s(m, case), flush=True)
" 2>&1 | grep -v Warning | tail -4 ;;
    *) echo "unknown stage $stage (one of: $all_stages)"; exit 2 ;;
  esac
done
say done
