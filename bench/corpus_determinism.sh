#!/usr/bin/env bash
# generate_corpus's promise on a GPU: one seed writes one corpus. Samples the same shard twice, each time from
# an empty inductor cache (what a fresh machine has), and prints both logged token digests and whether they
# agree. Four H200 sessions had written four corpora from one seed before the decoding step was compiled in
# inductor's deterministic mode (docs/reliability.md). After ../shared/tools/stage-teacher-for-device and a
# prefix (it reads results/teacher.cmf):
#   bash bench/corpus_determinism.sh [teacher.cmf] [settings JSON]
set -euo pipefail
export PYTHONPATH=/root/site:/root/smk:$PWD PYTHONUNBUFFERED=1
teacher=${1:-results/teacher.cmf}
settings=${2:-'{"sequences": 1024, "length": 1024, "batch": 512, "shards": 1}'}
digests=()
for run in 1 2; do
  cache=$(mktemp -d)
  line=$(TORCHINDUCTOR_CACHE_DIR=$cache python -m nvg.generate_corpus --teacher "$teacher" --shard 0 \
    --out "$cache/corpus.h5" --settings "$settings" 2>&1 | grep 'tokens blake2b')
  echo "run $run: $line"
  digests+=("$(sed -E 's/.*tokens blake2b ([0-9a-f]+).*/\1/' <<< "$line")")
  rm -rf "$cache"
done
[[ ${digests[0]} == "${digests[1]}" ]] && echo "same corpus" || { echo "DIFFERENT corpora"; exit 1; }
