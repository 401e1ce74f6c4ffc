#!/usr/bin/env bash
# The GPU machine's checks in one call, stages chosen by argument (default: tests bench train). Results land
# under $OUT. Each stage's timeout bounds that stage alone, not the stages together, so choose stages that fit one
# device call: on a cold Triton cache the GPU suite alone ran past 290 s, so split it with TESTS (bench/RESULTS.md,
# 2026-12-01 tenth session). dev/README.md lists the stages and the scripts they run.
#   dev/gpu_check.sh tests bench train train16 profile sanitizer bench-mg bench-torch
#   tests:  the kernel, op and model tests on the device (TESTS overrides the paths)
#   bench:  microgpt against torch.compile at micro-batch 32, 8, 96 (MBS overrides); the table in $OUT/bench.md
#   train:  ANDREA-12M (TRAIN_EXP: another experiment; TRAIN_PRECISION: another precision, e.g. fp8; TRAIN_TIMEOUT,
#           240 s): a short run, determinism, resume, the first steps against numpy (dev/train_check.py)
#   profile-modern: dev/profile_step.py --graph at PROFILE_MB (32) for GPT-2's step and the modern one in PRECISIONS
#           (bf16): their kernels by part, a column each ($OUT/profile-parts.md)
#   muon-repeat: dev/muon_repeat.py: which part of the GPU Muon step differs between identical runs ($OUT/muon_repeat.jsonl)
#   epilogues: the fusions' ways timed as the warm-up times them: dev/mlp_epilogue_bench.py at EPI_MBS (32 8: the MLP's
#           activation in our tiles, the TMA ones on sm_90) and dev/qkrope_epilogue_bench.py at EPI_MBS (QK-norm and
#           rotary's backward in attention's); $OUT/mlp_epilogue.txt, $OUT/qkrope_epilogue.txt
#   cache-save, cache-load: the Triton and tuning caches (.cache) as $OUT/caches.txz.00, .01, ... (xz: gzip's 57 MB
#           of the twenty-sixth session's caches did not fit; 15 MB parts, each
#           under the 16 MB a returned file may have; kept under 48 MB in all), and back from the parts copied into a
#           carried .gpu-cache/, so that the next call on a fresh machine starts warm
#   decode: the decode step's GPU tests, then bench/decode.py (ANDREA-120M, bf16, batches 1 and 32: microgpt's
#           prefill and graph-replayed decode against transformers, eager and compiled); rows in $OUT/decode.jsonl
#   serve:  bench/serve.py (ANDREA-120M random weights, bf16: 1, 8, 64 and 256 streams of short and 512-token prompts
#           against the decode step alone, then the chat workload); its rows and table in $OUT/serve.jsonl, serve's log
#           on failure in $OUT/serve.err; SERVE_ARGS adds flags (e.g. "--streams 1 8 --chat 0")
#   serve-locust: bench/serve.py --locust on a trained checkpoint: 1, 8, 64, 256 streams of short and 512-token
#           prompts from its own clients, then locust (bench/serve_locust.py) at the same streams against the same
#           server, each beside the decode step alone at that batch, then the chat workload; $OUT/serve-locust.jsonl.
#           The checkpoint: SERVE_CKPT, or SERVE_EXP (default experiments/ANDREA-120M-TRAIN.json; the modern block:
#           experiments/ANDREA-120M-MODERN-TRAIN.json) trained here (runs/serve-<name>, kept on a warm machine) for
#           SERVE_TRAIN_STEPS (300) steps of 4 micro-batches of 8 x 1024 tokens on the built-in corpus (its 50,304-entry
#           BPE and shards built first: ~50 s on a CPU): random weights make near-ties of the greedy picks. Carry
#           .whl/locust: locust's wheels for the device's Python 3.12 (dev/README.md: `pip download` line, 11 MiB)
#   serve-guidellm: serve-locust with guidellm (bench/serve_guidellm.py) for locust: after bench/serve.py's own rows,
#           guidellm's concurrent profile at the same streams and prompt lengths, GUIDELLM_SECONDS (15) each;
#           $OUT/serve-guidellm.jsonl. Carry .whl/guidellm: the 35 wheels guidellm needs beyond the image's packages
#           (dev/README.md: `pip download` line, 12 MB)
#   ab:     microgpt (PRECISIONS, default bf16) at MBS (default 32 8), "before" with AB_ENV in the environment (e.g.
#           AB_ENV="MICROGPT_GEMM=cublas": a tuning choice forced), "after" without, back to back; the warm-up's
#           candidate times in $OUT/ab-*.err (MICROGPT_TUNING_LOG)
#   ab-dir: AB_IMPL (microgpt; microgpt-modern: the modern block and Muon) at MBS (PRECISION, default bf16; STEPS 20,
#           WARMUP 5), BEFORE (default .before: `git archive C
#           microgpt bench experiments`, carried) then this tree, each with its own tuning cache, or with AB_CACHE=NAME
#           one cache for both (the choices both make are then the same: what differs is the change's own);
#           dev/fp8_gpu.sh ab runs it too
#   capped: `--micro-batch auto` under per-process caps (CAPS, default 7.5 11.5 23.5 GiB) for MODELS (12M 120M) x
#           PRECISIONS (bf16 fp8): the choice, the plan, the peaks against the cap, tokens/s ($OUT/capped.jsonl)
#   ce-race: dev/ce_race.py (the cross-entropy row kernel with GRAD against without) on BEFORE's package, then this
#           tree's
#   repeat: dev/loss_repeat.py --runs RUNS (3) per precision (fp8 bf16): which steps' losses and buffers differ
#   loss12: ANDREA-12M bf16 on the built-in corpus for LOSS_STEPS (300) steps, BEFORE's package then this tree, one
#           tuning cache (choices both share are the same), the validation loss every 100 steps (carry data/builtin);
#           AFTER_ENV: the after run's environment (e.g. a tuning choice forced: MICROGPT_LAYERNORM_BWD=r4w4);
#           LOSS_SETS: more overrides for both runs (e.g. "--set train.precision=fp8")
#   dp-profile: the kernels of a data-parallel replay on every rank (dev/dp_profile.py), 1 GPU then N
#   dp-agree, dp-resume, dp-speed: data parallel on 2 GPUs (dev/dp_check.py; ONLY=WORD: speed runs 1 GPU, N GPUs and
#           the variants whose label holds WORD; BEFORE=DIR adds an earlier package
#           to dp-speed, e.g. `git archive COMMIT microgpt | tar -x -C .before`, carried)
#   modern: the modern block's and Muon's tests on the device (every pair against NumPy, the step, decode)
#   modern-bench: bench.py rows microgpt against microgpt-modern (the modern block and Muon at the same size) at MBS
#           (default 32), PRECISIONS (bf16 fp8); the table in $OUT/modern-bench.md
#   modern-parity: dev/fp8_check.py parity12 on ANDREA-12M-MODERN: the built-in corpus, PARITY_STEPS (300) steps in
#           bf16 then fp8, the validation loss every 100 steps ($OUT/parity.jsonl)
#   ttl:    bench/ttl.py --shape TTL_SHAPE (120m) --sides TTL_SIDES (a,b,c) --budget-s TTL_BUDGET (200): time to loss;
#           the data stays in runs/ttl between calls on a warm machine; every side's JSON, ttl.json and ttl.png to $OUT.
#           TTL_SET: more --set assignments, space-separated (a lever on side d: TTL_SIDES=d
#           TTL_SET="d:model.value_embeds=3", after a call of side b)
#   repro:  dev/repro_table.py REPRO (default: 12m 120m 12m-modern 120m-modern): docs/ANDREA.md section 5's rows, each
#           model's data command (where its folder is missing) and train command as the table gives them; the rows
#           and the facts they rest on in $OUT/repro.txt (~15 minutes for all four: split them across calls)
# Carry: data (the built-in corpora; the machine rebuilds one where its Python's stdlib gives another key).
set -u
export PYTHONUNBUFFERED=1 MICROGPT_TEST_GPU=1 MICROGPT_CACHE="$PWD/.cache/microgpt" PYTHONPATH="$PWD"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.cache/triton}"  # under .cache: cache-save/cache-load carry it
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
stages=${*:-"tests bench train"}
log() { echo "=== $* ($(date +%T))"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
for s in $stages; do
  log "$s"
  case $s in
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m "gpu or not gpu" \
             ${TESTS:-tests/kernels tests/ops tests/test_model.py} -p no:cacheprovider 2>&1 \
             | tee "$OUT/tests.txt" | tail -25 ;;
    bench) rm -f "$OUT/bench-table.jsonl"  # rows as they finish: the table is made from them, even after a timeout
           timeout ${BENCH_TIMEOUT:-540} python3 bench/bench.py --impls compile microgpt --mbs ${MBS:-32 8 96} \
             --steps 30 --warmup 8 --timeout 170 --jsonl "$OUT/bench-table.jsonl" >/dev/null 2>"$OUT/bench.err"
           tail -3 "$OUT/bench.err" | cut -c1-400
           python3 -c 'import json, sys; from bench.bench import table
print(table([json.loads(line) for line in open(sys.argv[1])]))' "$OUT/bench-table.jsonl" | tee "$OUT/bench.md" ;;
    decode) timeout ${TEST_TIMEOUT:-180} python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider \
              tests/kernels/test_gpu_decode.py tests/kernels/test_decode.py tests/test_decode.py 2>&1 \
              | tee "$OUT/decode-tests.txt" | tail -15
            timeout ${BENCH_TIMEOUT:-360} python3 bench/decode.py 2>"$OUT/decode.err" | tee "$OUT/decode.jsonl" \
              | python3 -c 'import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items() if k != "tokens"})'
            tail -3 "$OUT/decode.err" | cut -c1-400 ;;
    serve-locust|serve-guidellm) client=${s#serve-}  # the outside load generator: its wheels in .whl/$client
           python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/$client-site \
             .whl/$client/*.whl 2>&1 | tail -2
           [ $client = locust ] || env PYTHONPATH=/tmp/guidellm-site python3 -m guidellm --version 2>&1 | tail -2
           exp=${SERVE_EXP:-experiments/ANDREA-120M-TRAIN.json}
           name=$(basename $exp .json); ckpt=${SERVE_CKPT:-runs/serve-${name#ANDREA-}}
           if [ -z "${SERVE_CKPT:-}" ] && ! ls $ckpt/ckpt/step-*.bin >/dev/null 2>&1; then
             timeout ${SERVE_TRAIN_TIMEOUT:-300} python3 -m microgpt train --json $exp \
               --out $ckpt --steps ${SERVE_TRAIN_STEPS:-300} --set data.source=builtin --set 'data.path=""' \
               --set train.n_micro=4 --set train.warmup_steps=30 --set train.eval_every=100000 \
               --set train.ckpt_every=100000 2>"$OUT/serve-train.err" | grep '"step"' | tail -1 | cut -c1-300
             tail -2 "$OUT/serve-train.err" | grep -iE "error|Traceback" | cut -c1-400
           fi
           if [ $client = locust ]; then outside=(--locust "env PYTHONPATH=/tmp/locust-site python3 -m locust")
           else outside=(--guidellm "env PYTHONPATH=/tmp/guidellm-site python3 -m guidellm"
                         --guidellm-seconds ${GUIDELLM_SECONDS:-15}); fi
           timeout ${SERVE_TIMEOUT:-540} python3 bench/serve.py --checkpoint $ckpt \
             "${outside[@]}" ${SERVE_ARGS:-} 2>"$OUT/$s.err" \
             | tee "$OUT/$s.jsonl" | python3 -c 'import json, sys
for line in sys.stdin:  # JSON rows without their texts, then the markdown tables as they are
    r = json.loads(line) if line.startswith("{") else line.rstrip("\n")
    print({k: v for k, v in r.items() if k != "texts"} if isinstance(r, dict) else r)'
           tail -3 "$OUT/$s.err" | cut -c1-400 ;;
    serve) timeout ${SERVE_TIMEOUT:-420} python3 bench/serve.py ${SERVE_ARGS:-} 2>"$OUT/serve.err" \
             | tee "$OUT/serve.jsonl" | python3 -c 'import json, sys
for line in sys.stdin:  # JSON rows without their texts, then the markdown table as it is
    r = json.loads(line) if line.startswith("{") else line.rstrip("\n")
    print({k: v for k, v in r.items() if k != "texts"} if isinstance(r, dict) else r)'
           tail -3 "$OUT/serve.err" | cut -c1-400 ;;
    epilogues) timeout 240 python3 dev/mlp_epilogue_bench.py ${EPI_MBS:-32 8} >"$OUT/mlp_epilogue.txt" 2>&1
               timeout 240 python3 dev/qkrope_epilogue_bench.py ${EPI_MBS:-32 8} >"$OUT/qkrope_epilogue.txt" 2>&1
               tail -n 25 "$OUT/mlp_epilogue.txt" "$OUT/qkrope_epilogue.txt" | cut -c1-300 ;;
    muon-repeat) timeout 240 python3 dev/muon_repeat.py 2>&1 | tee "$OUT/muon_repeat.jsonl" | cut -c1-600 ;;
    cache-load) ls .gpu-cache/caches.txz.* >/dev/null 2>&1 && cat .gpu-cache/caches.txz.* | xz -dc | tar -xf - \
                  && du -sh .cache ;;
    cache-save) tar -cf - .cache | xz -T0 -6 -c | split -b 15M -d - "$OUT/caches.txz." && ls -l "$OUT"/caches.txz.* \
                  && [ "$(cat "$OUT"/caches.txz.* | wc -c)" -lt 48000000 ] || { echo "caches over 48 MB: not kept"; rm -f "$OUT"/caches.txz.*; } ;;
    train) timeout ${TRAIN_TIMEOUT:-240} python3 dev/train_check.py ${TRAIN_EXP:-experiments/ANDREA-12M-TRAIN.json} \
             /tmp/tc12 --steps ${TRAIN_STEPS:-200} --numpy-steps ${NUMPY_STEPS:-5} \
             ${TRAIN_PRECISION:+--precision $TRAIN_PRECISION} 2>&1 | grep -v '^step ' \
             | tee "$OUT/train.jsonl" | cut -c1-600 ;;
    train16) timeout 200 python3 dev/train_check.py experiments/ANDREA-12M-TRAIN.json /tmp/tc12h --precision fp16 \
               --steps ${TRAIN16_STEPS:-300} 2>&1 | grep -v '^step ' | tee "$OUT/train16.jsonl" | cut -c1-600 ;;
    profile) timeout 150 python3 dev/profile_step.py ${PROFILE_MB:-8} 2>&1 \
               | tee "$OUT/profile${PROFILE_MB:-8}.txt" | head -40 ;;
    profile-modern) files=()  # GPT-2's step and the modern step's, by part, side by side (the graph replayed)
           for p in ${PRECISIONS:-bf16}; do for b in "" --modern; do f="$OUT/prof${b:+-modern}-$p.json"
             timeout 150 python3 dev/profile_step.py ${PROFILE_MB:-32} $p --graph $b --json "$f" >/dev/null 2>>"$OUT/profile.err" \
               && files+=("$f"); done; done
           python3 dev/profile_step.py --parts "${files[@]}" | tee "$OUT/profile-parts.md" ;;
    sanitizer) for tool in memcheck racecheck; do
                 echo "--- $tool"; timeout ${SAN_TIMEOUT:-200} compute-sanitizer --tool $tool --print-limit 20 \
                   python3 dev/tiny_step.py bf16 2>&1 | tail -6; echo "rc=${PIPESTATUS[0]}"; done \
                 | tee "$OUT/sanitizer.txt" ;;
    ab) for mb in ${MBS:-32 8}; do for p in ${PRECISIONS:-bf16}; do for v in before after; do
          env $([ $v = before ] && echo ${AB_ENV:-}) MICROGPT_TUNING_LOG=1 \
            timeout 170 python3 bench/bench.py --impl microgpt --mb $mb --precision $p --steps ${STEPS:-30} --warmup 8 \
            2>"$OUT/ab-$v-$p-$mb.err" | python3 -c 'import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(json.dumps({"run": sys.argv[1], **{k: r.get(k) for k in ("mb", "precision", "tokens_per_s", "step_ms",
          "loss_first", "loss_last", "peak_steady", "planned")}}))' $v | tee -a "$OUT/ab.jsonl"
          grep -E "^tuning ${AB_TABLES:-}" "$OUT/ab-$v-$p-$mb.err" | cut -c1-300
          tail -2 "$OUT/ab-$v-$p-$mb.err" | grep -iE "error|Traceback" | cut -c1-400; done; done; done ;;
    ab-dir) for mb in ${MBS:-32 8}; do for v in before after; do  # BEFORE=DIR (default .before): microgpt + bench
          root=$([ $v = before ] && echo ${BEFORE:-.before} || echo .)
          MICROGPT_CACHE="$PWD/.cache/${AB_CACHE:-$v}" MICROGPT_TUNING_LOG=1 timeout 170 python3 $root/bench/bench.py --impl ${AB_IMPL:-microgpt} \
            --mb $mb --precision ${PRECISION:-bf16} --steps ${STEPS:-20} --warmup ${WARMUP:-5} 2>"$OUT/abdir-$v-$mb.err" \
            | python3 -c 'import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(json.dumps({"run": sys.argv[1], **{k: r.get(k) for k in ("mb", "precision", "tokens_per_s", "step_ms",
          "sm_mhz", "watts", "loss_first", "loss_last", "steady_vs_plan")}}))' $v | tee -a "$OUT/ab.jsonl"
          tail -2 "$OUT/abdir-$v-$mb.err" | grep -iE "error|Traceback" | cut -c1-400; done; done ;;
    loss12) for v in before after; do  # ANDREA-12M bf16, LOSS_STEPS steps, BEFORE's package then this one: one cache
          root=$([ $v = before ] && echo ${BEFORE:-.before} || echo .)
          rm -rf /tmp/loss12-$v  # a warm machine keeps the last call's run folders
          (cd $root && env $([ $v = after ] && echo ${AFTER_ENV:-}) MICROGPT_CACHE="$OLDPWD/.cache/loss12" MICROGPT_DATA_DIR="$OLDPWD/data" PYTHONPATH=. \
             timeout 240 python3 -m microgpt train --json "$OLDPWD/experiments/ANDREA-12M-TRAIN.json" --out /tmp/loss12-$v \
             --steps ${LOSS_STEPS:-300} --set data.source=builtin --set 'data.path=""' --set train.eval_every=100 ${LOSS_SETS:-} \
             2>"$OUT/loss12-$v.err") | grep '"eval"' | sed "s/^/$v /" | tee -a "$OUT/loss12.txt"
          tail -2 "$OUT/loss12-$v.err" | grep -iE "error|Traceback" | cut -c1-400; done ;;
    capped) for cap in ${CAPS:-7.5 11.5 23.5}; do for model in ${MODELS:-12M 120M}; do for p in ${PRECISIONS:-bf16 fp8}; do
          # --micro-batch auto under a per-process cap (dev/capped_train.py), builtin data, CAPPED_STEPS steps: one
          # JSON line each with the choice, the plan, the allocator's peaks against the cap and the last tokens/s
          timeout 200 python3 dev/capped_train.py $cap train experiments/ANDREA-$model-TRAIN.json --out /tmp/cap-$cap-$model-$p \
            --steps ${CAPPED_STEPS:-4} --micro-batch auto --json --set data.source=builtin --set 'data.path=""' \
            --set train.eval_every=1000 --set train.precision=$p >/tmp/cap.out 2>/tmp/cap.err
          rc=$?; rm -rf /tmp/cap-$cap-$model-$p
          python3 -c 'import json, sys
out = [json.loads(line) for line in open("/tmp/cap.out") if line.startswith("{")]
err = open("/tmp/cap.err").read().splitlines()
capped = [json.loads(line) for line in err if "\"event\": \"capped\"" in line]
steps = [r for r in out if r.get("event") == "step"]
start = next((r for r in out if r.get("event") == "start"), {})
t = start.get("config", {}).get("train", {})
print(json.dumps({"cap_gib": float(sys.argv[1]), "model": sys.argv[2], "precision": sys.argv[3], "rc": int(sys.argv[4]),
      "micro_batch": t.get("micro_batch"), "n_micro": t.get("n_micro"),
      "auto": next((line for line in err if line.startswith("train.micro_batch auto")), None),
      **(capped[-1] if capped else {}), "tokens_per_s": [round(r["tokens_per_s"]) for r in steps],
      "error": [line for line in err if line.startswith("error")][:1] or (err[-1:] if int(sys.argv[4]) else [])}))' $cap $model $p $rc | tee -a "$OUT/capped.jsonl"
          done; done; done ;;
    ce-race) for v in before after; do  # dev/ce_race.py on BEFORE's package (default .before), then this tree's
          root=$([ $v = before ] && echo ${BEFORE:-.before} || echo .)
          PYTHONPATH=$root timeout 150 python3 dev/ce_race.py --reps ${RACE_REPS:-200} ${RACE_ARGS:-} 2>>"$OUT/ce-race.err" \
            | sed "s/^/$v /" | tee -a "$OUT/ce-race.txt"; done ;;
    repeat) for p in ${PRECISIONS:-fp8 bf16}; do  # issue 35: two or more identical runs, their reported losses
          timeout ${REPEAT_TIMEOUT:-200} python3 dev/loss_repeat.py --precision $p --runs ${RUNS:-3} --steps ${REPEAT_STEPS:-80} \
            ${REPEAT_ARGS:-} 2>>"$OUT/repeat.err" | tee -a "$OUT/repeat.jsonl" | cut -c1-1500; done ;;
    bench-mg) timeout 400 python3 bench/bench.py --impls microgpt --mbs ${MBS:-8 32} --jsonl "$OUT/bench.jsonl" \
                2>&1 | tail -8 ;;
    bench-torch) timeout 560 python3 bench/bench.py --impls eager compile --mbs ${MBS:-8 32} --timeout 200 \
                   --jsonl "$OUT/bench.jsonl" 2>&1 | tail -8 ;;
    dp-agree|dp-resume) timeout 300 python3 dev/dp_check.py ${s#dp-} --gpus ${GPUS:-2} 2>&1 | tail -4 \
               | tee "$OUT/$s.jsonl" | cut -c1-1500 ;;
    dp-speed) timeout 560 python3 dev/dp_check.py speed --gpus ${GPUS:-2} --mbs ${MBS:-32 8} \
                ${BEFORE:+--before $BEFORE} ${ONLY:+--only $ONLY} 2>&1 | tee "$OUT/dp-speed.txt" | tail -16 ;;
    dp-profile) d="/tmp/dp-profile-${PROFILE_MB:-32}"; mkdir -p "$OUT/dp-profile"
                for n in 1 ${GPUS:-2}; do echo "== dp_profile --gpus $n"; base=""
                  [ "$n" -gt 1 ] && base="--baseline $d/gpus1"
                  timeout 200 python3 dev/dp_profile.py --mb ${PROFILE_MB:-32} --replays 5 --gpus $n --out "$d/gpus$n" \
                    $base 2>>"$OUT/dp-profile/err" | tee -a "$OUT/dp-profile/rows.jsonl" | cut -c1-1200; done
                tar czf "$OUT/dp-profile/traces.tgz" -C "$d" . ;;
    modern) timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider \
              tests/kernels/test_gpu_modern.py tests/kernels/test_gpu_qkrope.py tests/kernels/test_muon.py \
              tests/kernels/test_modern_step.py tests/kernels/test_rmsnorm.py tests/kernels/test_relu2.py \
              tests/kernels/test_qkrope.py tests/test_modern.py 2>&1 | tee "$OUT/modern-tests.txt" | tail -25 ;;
    modern-bench) rm -f "$OUT/modern-bench.jsonl"
           for p in ${PRECISIONS:-bf16 fp8}; do
             impls="microgpt microgpt-modern"; [ $p = fp8 ] && impls="microgpt-fp8 microgpt-modern-fp8"
             timeout ${BENCH_TIMEOUT:-300} python3 bench/bench.py --impls $impls --mbs ${MBS:-32} --steps ${STEPS:-20} \
               --warmup ${WARMUP:-5} --timeout 140 --jsonl "$OUT/modern-bench.jsonl" >/dev/null 2>>"$OUT/modern-bench.err"
           done
           tail -3 "$OUT/modern-bench.err" | cut -c1-400
           python3 -c 'import json, sys; from bench.bench import table
print(table([json.loads(line) for line in open(sys.argv[1])]))' "$OUT/modern-bench.jsonl" | tee "$OUT/modern-bench.md" ;;
    modern-parity) rm -f "$OUT/parity.jsonl"
           timeout 480 python3 dev/fp8_check.py parity12 --experiment experiments/ANDREA-12M-MODERN-TRAIN.json \
             --steps ${PARITY_STEPS:-300} --eval-every 100 --jsonl "$OUT/parity.jsonl" 2>&1 | tail -4 | cut -c1-1200 ;;
    ttl) sets=(); for a in ${TTL_SET:-}; do sets+=(--set "$a"); done
         timeout ${TTL_TIMEOUT:-580} python3 bench/ttl.py --shape ${TTL_SHAPE:-120m} --sides ${TTL_SIDES:-a,b,c} \
           --budget-s ${TTL_BUDGET:-200} "${sets[@]}" 2>&1 | tee "$OUT/ttl-${TTL_SIDES:-abc}.log" | tail -30
         cp -f runs/ttl/${TTL_SHAPE:-120m}/*.json runs/ttl/${TTL_SHAPE:-120m}/*.png "$OUT/" 2>/dev/null ;;
    repro) timeout ${REPRO_TIMEOUT:-590} python3 dev/repro_table.py ${REPRO:-12m 120m 12m-modern 120m-modern} \
             2>"$OUT/repro.err" | tee -a "$OUT/repro.txt"
           tail -3 "$OUT/repro.err" | grep -iE "error|Traceback|exit" | cut -c1-400 ;;
    *) echo "unknown stage $s (tests bench decode serve train train16 profile sanitizer ab ab-dir capped ce-race repeat loss12 bench-mg bench-torch dp-agree dp-resume dp-speed dp-profile modern modern-bench modern-parity ttl muon-repeat epilogues cache-load cache-save profile-modern repro)" ;;
  esac
done
cp -f "$MICROGPT_CACHE"/*.json "$OUT/" 2>/dev/null
log done
