#!/usr/bin/env bash
# precision "fp8" on the GPU machine, stages by argument (results under $OUT):
#   dev/fp8_gpu.sh probe tests quick profile suite
#   probe:   which alignments of the inverse scale's address cuBLASLt's FP8 GEMM takes
#   tests:   the fp8 kernel and step tests on the device (tests/kernels/test_fp8.py, test_gpu.py -k fp8)
#   quick:   bench.py, microgpt bf16 and fp8 at micro-batch 32 and 8 (MBS), one JSON line each
#   profile: where an fp8 step's time goes (dev/profile_step.py 32 fp8)
#   suite:   the kernel, op and model tests (every precision: the linear and MLP backward changed for all)
#   parity12, parity120, resume: dev/fp8_check.py (bf16 against fp8; SIGTERM + resume in fp8); DATA=data/sitepy
#            trains them on the corpus prep-big makes (the Python sources of torch and triton, 13.4M tokens);
#            prep-big runs as well on the CPU machine (PATH=.venv/bin:$PATH DIR=.venv/lib/python3.11/site-packages)
#            and data/sitepy then travels with `carry`
#   cast:    dev/cast_bench.py (every cast of a step, every launch configuration)
#   weights: dev/weight_cast_bench.py (the weights' cast of a step, as it runs and as it ran; AdamW beside it)
#   ab:      microgpt (PRECISION, default fp8) at MBS, BEFORE (default .before: `git archive C microgpt bench
#            experiments`) then this tree, each with its own tuning cache (dev/gpu_check.sh ab-dir at 30 steps, warm-up 8)
#   limits:  dev/cast_limits.py (what holds a cast: variants without a part) and ncu on k_cast, where it reads counters
#   bench:   bench.py's table: torch.compile, torchao float8, microgpt bf16 and fp8 at MBS (default 32 8)
# Carry .whl (ml_dtypes: the NumPy reference the fp8 tests compare with).
set -u
export PYTHONUNBUFFERED=1 MICROGPT_TEST_GPU=1 MICROGPT_CACHE="$PWD/.cache/microgpt"
OUT=${OUT:-/tmp/fp8_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
log() { echo "=== $* ($(date +%T))"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
for s in ${*:-tests quick profile suite}; do
  log "$s"
  case $s in
    probe) python3 -c '
import torch
a = torch.randn(256, 256, device="cuda").to(torch.float8_e4m3fn)
out = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
buf = torch.ones(16, device="cuda")
for off in (0, 1, 2, 4):
    try:
        torch._scaled_mm(a, a.t(), buf[off:off + 1], buf[off:off + 1], out_dtype=torch.bfloat16, out=out)
        torch.cuda.synchronize(); print("scale at byte", 4 * off, "ok")
    except RuntimeError as e:
        print("scale at byte", 4 * off, "fails:", str(e)[:120])' ;;
    tests) timeout 240 python3 -m pytest -q -m "gpu or not gpu" tests/kernels/test_fp8.py tests/kernels/test_gpu.py \
             -k fp8 -p no:cacheprovider 2>&1 | tee "$OUT/fp8-tests.txt" | tail -40 | cut -c1-400 ;;
    quick) for mb in ${MBS:-32 8}; do for p in ${PRECISIONS:-bf16 fp8}; do
             timeout 150 python3 bench/bench.py --impl microgpt --mb $mb --precision $p --steps ${STEPS:-20} \
               --warmup 5 2>"$OUT/quick-$p-$mb.err" | tee -a "$OUT/quick.jsonl" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line); g = r.pop("gemm", {})
    print({k: r[k] for k in ("impl", "mb", "precision", "tokens_per_s", "step_ms", "mfu", "loss_first", "loss_last",
                             "first_vs_plan", "steady_vs_plan")})'
             tail -3 "$OUT/quick-$p-$mb.err" | cut -c1-600; done; done ;;
    profile) timeout 150 python3 dev/profile_step.py ${PROFILE_MB:-32} fp8 2>&1 | tee "$OUT/profile-fp8.txt" \
               | head -${PROFILE_LINES:-45} | cut -c1-200 ;;
    suite) timeout ${SUITE_TIMEOUT:-300} python3 -m pytest -q -m "gpu or not gpu" tests/kernels tests/ops \
             tests/test_model.py -p no:cacheprovider 2>&1 | tee "$OUT/suite.txt" | tail -25 | cut -c1-400 ;;
    prep-big) site=${DIR:-$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')}
              src=/tmp/pysrc; rm -rf $src  # the .py files only: prep reads a folder's .json files as records
              (cd "$site" && find torch triton -name '*.py' -exec install -D {} "$src/{}" \;)
              timeout 400 python3 -m microgpt prep --source $src/torch --source $src/triton --out data/sitepy \
                --vocab-size 4096 --val-fraction 0.01 --quiet 2>&1 | tail -3
              python3 -c 'import json; m = json.load(open("data/sitepy/manifest.json")); print(m["splits"])' ;;
    parity12|parity120|resume) timeout ${CHECK_TIMEOUT:-300} python3 dev/fp8_check.py $s ${DATA:+--data $DATA} 2>&1 \
               | tee "$OUT/$s.jsonl" | cut -c1-1500 ;;
    limits) timeout 300 python3 dev/cast_limits.py ${PROFILE_MB:-32} 2>&1 | tee "$OUT/cast_limits.txt"
            timeout 200 ncu --clock-control none -k regex:k_ --section SpeedOfLight --section MemoryWorkloadAnalysis \
              --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
              python3 dev/cast_limits.py ${PROFILE_MB:-32} --ncu > "$OUT/cast_ncu.txt" 2>&1
            grep -E "^  [a-z_]+|Duration|L1/TEX Cache|DRAM Throughput|Compute \(SM\)|Registers|Achieved Occ" \
              "$OUT/cast_ncu.txt" | head -${NCU_LINES:-90} | cut -c1-160 ;;
    ab) PRECISION=${PRECISION:-fp8} STEPS=${STEPS:-30} WARMUP=8 OUT="$OUT" bash dev/gpu_check.sh ab-dir ;;
    cast) timeout 120 python3 dev/cast_bench.py ${PROFILE_MB:-32} 2>&1 | tee "$OUT/cast_bench.txt" ;;
    weights) timeout 100 python3 dev/weight_cast_bench.py 2>&1 | tee "$OUT/weight_cast.txt" ;;
    bench) rm -f "$OUT/bench-table.jsonl"
           timeout ${BENCH_TIMEOUT:-560} python3 bench/bench.py --impls ${IMPLS:-compile torchao microgpt microgpt-fp8} \
             --mbs ${MBS:-32 8} --steps 20 --warmup 5 --timeout 200 --jsonl "$OUT/bench-table.jsonl" \
             >/dev/null 2>"$OUT/bench.err"
           tail -3 "$OUT/bench.err" | cut -c1-400
           python3 -c 'import json, sys; from bench.bench import table
print(table([json.loads(line) for line in open(sys.argv[1])]))' "$OUT/bench-table.jsonl" | tee "$OUT/bench.md" ;;
    *) echo "unknown stage $s (probe tests quick profile suite prep-big parity12 parity120 resume cast weights limits ab bench)" ;;
  esac
done
log done
