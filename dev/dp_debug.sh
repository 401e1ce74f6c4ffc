#!/usr/bin/env bash
# Two ranks started by hand (no launcher), each under `timeout -s ABRT` with Python's faulthandler, so a hang
# leaves every thread's stack in $OUT/PREFIX-rR.err. Usage: dev/dp_debug.sh PREFIX SECONDS [PYTHONPATH] [train args]
set -u
prefix=$1 secs=$2 pp=${3:-$PWD}; shift 3
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29500 + RANDOM % 1000)) WORLD_SIZE=2 PYTHONFAULTHANDLER=1 \
  PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN MICROGPT_CACHE="$PWD/.cache/microgpt"
for r in 0 1; do
  (cd "$pp" && RANK=$r LOCAL_RANK=$r timeout -s ABRT "$secs" python3 -m microgpt.cli train \
     "$OLDPWD/experiments/ANDREA-12M-TRAIN.json" --out /tmp/dbg-$prefix-$r --set data.source=builtin \
     --set 'data.path=""' "$@" >"$OUT/$prefix-r$r.out" 2>"$OUT/$prefix-r$r.err") &
done
wait
for r in 0 1; do echo "--- $prefix rank $r: $(grep -c '"step"' "$OUT/$prefix-r$r.out") step lines"; tail -c 1500 "$OUT/$prefix-r$r.err"; done
