#!/usr/bin/env bash
# The README's GPU training step (live teacher + signs, grad_clip 2, hidden loss 0.3, the f16 embedding trained since
# session 48; bench/gpu_bench.py --modes) in the variants that ask where its host time goes (issue #18; docs/quality.md,
# session 46), each beside the dense transformers step in its own process, after ../shared/tools/stage-teacher-for-device's
# wheels and Snakemake (no teacher needed).
#   bash bench/step_overhead.sh VARIANT ...     each variant's JSON and log to $OUT, its row printed
# Variants: uniform (1 bpw, P = 2, the bench's student), plan055 (session 46's 0.55-bpw mixed plan, eleven block
# signatures), plan055_own_caches (the same, a dynamo cache per signature), cudagraphs (uniform, compile mode
# reduce-overhead: train.cuda_graphs), torch_adam (uniform, torch's fused Adam a group a tensor: train_student's
# optimizer before session 48's nvg.adam.OnePassAdam), profile and plan055_profile (with torch.profiler's tables).
# About 2 minutes each on an H100 (compiles included), so four fit in one call's 600 s; STEP_LIMIT_S (default 170)
# stops a variant that hangs in compilation and keeps the others.
set -uo pipefail
export PYTHONPATH=/root/site:/root/smk:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/inductor-cache
MODE="live + signs, grad_clip 2, hidden 0.3, embedding trained"
PLAN=docs/runs/budget-s46-live_uv_bsigns_055-hidden03-manuals30.log
for variant in "$@"; do
  case $variant in
    uniform) args=() ;;
    plan055) args=(--plan-log "$PLAN") ;;
    plan055_own_caches) args=(--plan-log "$PLAN" --graph-per-signature) ;;
    cudagraphs) args=(--compile-mode reduce-overhead) ;;
    torch_adam) args=(--adam torch-groups) ;;
    profile) args=(--profile) ;;
    plan055_profile) args=(--plan-log "$PLAN" --profile) ;;
    *) echo "step_overhead.sh: no variant $variant" >&2; exit 2 ;;
  esac
  timeout -k 10 "${STEP_LIMIT_S:-170}" python bench/gpu_bench.py --modes --only "$MODE" --iters 4 --windows 3 \
    --out "$OUT/step-$variant.json" "${args[@]}" > "$OUT/step-$variant.log" 2>&1
  echo "$variant: exit $?"
  python -c 'import json, sys
rows = json.load(open(sys.argv[1]))["step"]["SmolLM2-135M"]
for name, row in rows.items():
    if isinstance(row, dict): print(" ", name, {k: v for k, v in row.items() if k != "profile"})' "$OUT/step-$variant.json" 2>/dev/null
done
