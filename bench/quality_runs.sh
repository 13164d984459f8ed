#!/usr/bin/env bash
# The comparisons of docs/training.md and docs/benchmarks.md at equal tokens, calling the step modules
# directly (the device has no snakemake). Two phases, one device call each; a phase skips what exists.
#   bash bench/quality_runs.sh prepare   teacher → windows, top-k, Grams, the student at $BPW; the encoder
#                                        profile; training without signs and with signs (η = $SIGN_ETA)
#   bash bench/quality_runs.sh more      DTG-MA keep 0.75 + the same training; 1 and 2 processes (DDP);
#                                        evaluate every student
# Needs $TEACHER (a .gguf, HF folder or .cmf) and $OUT; sizes from the variables below.
set -euo pipefail
W=${WORKDIR:-/root/w}; TOKENS=${TOKENS:-1048576}; WINDOW=${WINDOW:-512}; EVAL_WINDOWS=${EVAL_WINDOWS:-64}
BPW=${BPW:-0.55}; BATCH=${BATCH:-32}; EPOCHS=${EPOCHS:-2}; LR=${LR:-0.002}; SIGN_ETA=${SIGN_ETA:-0.05}
ALIGN=${ALIGN:-128}; DTGMA_STEPS=${DTGMA_STEPS:-200}; DDP_BATCH=${DDP_BATCH:-32}; DDP_STEPS=${DDP_STEPS:-60}
mkdir -p "$W" "$OUT"
step() { echo "== $(date +%T) $*" | tee -a "$OUT/steps.log"; }
train() {  # name student extra-settings-json
  [[ -e $W/$1.cmf ]] && return
  step "train $1"
  python -m nvg.train_student --student "$2" --windows "$W/windows.h5" --topk "$W/topk.0.h5" --teacher-name teacher \
    --out "$W/$1.cmf" --metrics "$OUT/metrics-$1.jsonl" --settings \
    "{\"epochs\": $EPOCHS, \"batch\": $BATCH, \"lr\": $LR, \"eval_every\": 32, \"state_every\": 0, \"state_root\": \"$W/state\"$3}" \
    2> "$OUT/train-$1.log"
  tail -3 "$OUT/train-$1.log"
}
evaluate() {  # name student
  step "evaluate $1"
  python -m nvg.evaluate --teacher "$W/teacher.cmf" --encoded "$W/encoded.cmf" --final "$W/$1.cmf" \
    --windows "$W/windows.h5" --topk "$W/topk.0.h5" --out "$OUT/eval-$1.json" \
    --settings '{"batch": 16, "ood": ["python-docs"], "ood_tokens": 16384}' 2> "$OUT/eval-$1.log"
  tail -1 "$OUT/eval-$1.log"
}
case $1 in
prepare)
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee "$OUT/versions.txt"
  [[ -e $W/teacher.cmf ]] || { step import; python -m nvg.import_teacher --source "$TEACHER" --out "$W/teacher.cmf"; }
  [[ -e $W/windows.h5 ]] || { step tokenize; python -m nvg.tokenize_windows --teacher "$W/teacher.cmf" --out "$W/windows.h5" --settings \
    "{\"sources\": [{\"path\": \"pkg:shksprdata/texts/*_gut.txt\"}, {\"path\": \"pkg:bible/data/kjv.jsonl\"}], \"tokens\": $TOKENS, \"window\": $WINDOW, \"eval_windows\": $EVAL_WINDOWS}"; }
  [[ -e $W/topk.0.h5 ]] || { step topk; python -m nvg.teacher_topk --teacher "$W/teacher.cmf" --windows "$W/windows.h5" --shard 0 --out "$W/topk.0.h5" --settings '{"k": 64, "shards": 1, "batch": 32}'; }
  [[ -e $W/grams.h5 ]] || { step grams; python -m nvg.gram_capture --model "$W/teacher.cmf" --windows "$W/windows.h5" --out "$W/grams.h5" --settings '{"fit_windows": 128, "sel_windows": 64, "batch": 32}'; }
  [[ -e $W/encoded.cmf ]] || { step "encode $BPW"; python -m nvg.budget_reencode --teacher "$W/teacher.cmf" --grams "$W/grams.h5" --out "$W/encoded.cmf" --report "$OUT/encode.json" --settings "{\"bpw\": $BPW}" 2> "$OUT/encode.log"; tail -1 "$OUT/encode.log"; }
  step "encoder profile"; python bench/encode_profile.py "$W/teacher.cmf" "$W/grams.h5" "$OUT/encode_profile.json" --layers 2 --bpw ${PROFILE_BPW:-1.0} > /dev/null
  train base "$W/encoded.cmf" ""
  train signs "$W/encoded.cmf" ", \"signs\": {\"enabled\": true, \"eta\": $SIGN_ETA}"
  ;;
more)
  [[ -e $W/masked.cmf ]] || { step "dtgma keep 0.75"; python -m nvg.dtgma_cut --student "$W/encoded.cmf" --windows "$W/windows.h5" --topk "$W/topk.0.h5" --out "$W/masked.cmf" \
    --settings "{\"keep\": 0.75, \"align\": $ALIGN, \"max_steps\": $DTGMA_STEPS, \"eval_every\": 25, \"batch\": 16}" 2> "$OUT/dtgma.log"; tail -1 "$OUT/dtgma.log"; }
  train cut "$W/masked.cmf" ""
  gpus=$(python -c "import torch; print(max(1, torch.cuda.device_count()))")
  for n in 1 2; do
    [[ $n -gt 1 && $gpus -lt 2 && ${ALLOW_CPU_DDP:-0} != 1 ]] && continue
    step "ddp $n processes"
    torchrun --standalone --nproc_per_node $n -m nvg.train_student --student "$W/encoded.cmf" --windows "$W/windows.h5" --topk "$W/topk.0.h5" \
      --out "$W/ddp-$n.cmf" --metrics "$OUT/metrics-ddp-$n.jsonl" --settings \
      "{\"epochs\": 1, \"batch\": $DDP_BATCH, \"lr\": $LR, \"eval_every\": 1000, \"state_every\": 0, \"stop_after\": $DDP_STEPS, \"gpus\": $n, \"state_root\": \"$W/state-ddp\"}" \
      2> "$OUT/train-ddp-$n.log"
    tail -2 "$OUT/train-ddp-$n.log"
  done
  for name in base signs cut; do [[ -e $W/$name.cmf ]] && evaluate $name; done
  ls -l "$W"/*.cmf | tee "$OUT/sizes.txt"
  ;;
esac
step done
