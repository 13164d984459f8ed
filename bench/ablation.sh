#!/usr/bin/env bash
# The quality ablation of docs/quality.md through the real workflow on a GPU machine, after
# ../shared/tools/stage-teacher-for-device's three calls (snakemake and the wheels under /root).
#   bash bench/ablation.sh prefix              the stages every variant shares (teacher → generated corpus →
#                                              windows → top-k → Grams → encoded student), here, on GPU 0
#   bash bench/ablation.sh corpus-out [NAME]   the generated corpus (here, or variant NAME's) to $OUT/corpus/,
#                                              for the next session
#   NAME is bench/ablation/NAME.yaml over base.yaml; A+B overlays B on A (e.g. live_uv_bsigns_wide+embedding_q2tp)
#   bash bench/ablation.sh start NAME[:GPU] ...  each GPU's variants one after another in a detached process that runs
#                                              on between device calls; `collect SECONDS` waits and sends back;
#                                              GPU 0b: a second chain on GPU 0 beside a running one;
#                                              `stop GPU` ends that chain now
#   bash bench/ablation.sh run NAME[:GPU] ...  each variant (bench/ablation/NAME.yaml over base.yaml) in its
#                                              own copy of this checkout with those results, one per GPU, in
#                                              parallel; then its eval.json, metrics, logs and stage times to $OUT
# A variant's copy stays under /root/ablation/NAME while the machine is warm: run it again to resume a
# stopped training (train_student's saved state) or to reuse what it finished. Snakemake and its jobs are
# interrupted after ABLATION_LIMIT_S seconds (default 540), inside the device's 10-minute call limit, so that
# a variant that does not finish still sends back its logs and metrics (session 10 lost a 0.55 bpw run's log
# to that limit), and train_student saves its state at the step it stops.
# ABLATION_CORES (default 8) is a variant's --cores: a torch stage claims 8 (TORCH_THREADS), so 16 runs two
# corpus shards side by side on the one GPU (session 17: both in about 200 s, where one alone takes about 210
# with the decoder's compile), for a variant run alone.
# ABLATION_DEADLINE_S: the epochs each variant of a chain trains are fitted to what is left of that many seconds after
# its stages before the training (variant_fit_epochs, below).
# ABLATION_EXTRA: more overlay files, after the variant's (e.g. bench/ablation/first300.yaml: the first 300 steps of the
# variant's schedule, where sessions 22 and 23's avalanches began).
# PREFIX_TARGETS and RUN_TARGETS replace the default targets, so that one variant can be split between device
# calls where Snakemake's DAG splits it (e.g. RUN_TARGETS=results/student/reconstructed.cmf in the call that
# ends the prefix, then the training in the next): no step is trained twice and nothing compiles twice.
set -euo pipefail
export PYTHONPATH=/root/site:/root/smk:$PWD PATH=/root/smk/bin:$PATH PYTHONUNBUFFERED=1
# Inductor's cache where the machine keeps files between calls: a call that resumes train_student compiled its
# first step for 70 s again in session 21 (the default cache sits under /tmp).
export TORCHINDUCTOR_CACHE_DIR=/root/inductor-cache
BASE=${ABLATION_BASE:-bench/ablation/base.yaml}  # another base: e.g. config.yaml, to try this script on the CPU job
# Every device call copies this checkout afresh, so every source file has a new mtime and Snakemake's
# default triggers would rerun the shared prefix in each variant's copy (session 7 lost ~3 GPU minutes
# a variant, and its variants trained on different corpora). A changed setting or rule still reruns.
TRIGGERS="--rerun-triggers params input software-env code"
# The teacher's text outlives the machine: `corpus-out` gzips each shard into parts of at most 15 MiB under
# $OUT/corpus/ (a call brings back 8 files of at most 16 MiB), a later session copies them into .corpus/ (not
# under .device/, which the staging script deletes and rebuilds) and carries that folder (beside the snakemake
# wheels in the third staging call), and this script then starts
# from them: base.yaml's shard took 212 s of the 30 device minutes in session 20 (122 s of it compiling the
# decoder), the wide corpus's two shards about 300. (Inductor's cache, which would save that compile and
# train_student's 68 s, packed to 67 MB: more than a call brings back.) Snakemake has no record of the carried
# shards, so the teacher is imported first and the shards touched after it (else their older mtime reruns
# them); tokenize_windows still checks each shard's teacher, place and token digest. The shards must be what
# the config's generate_corpus wrote: the digests printed here are compared with the log of the session that made
# them. (A change to the decoder's draws makes a seed write another corpus, while the carried one stays what it was:
# session 63's `a7bac851…`/`72895357…` are the stage's output before 7f40589, so runs on them compare with each other.)
if compgen -G ".corpus/generated.*.h5.gz.*" > /dev/null && [[ ! -d results/corpus && $1 =~ ^(prefix|run|start)$ ]]; then
  mkdir -p results/corpus
  for first in .corpus/generated.*.h5.gz.aa; do
    name=$(basename "${first%.gz.aa}"); cat ".corpus/$name.gz."* | gunzip > "results/corpus/$name"
  done
  snakemake --cores 16 results/teacher.cmf $TRIGGERS --quiet rules --configfile $BASE 2>&1 | tail -3
  touch results/corpus/*.h5
  python -c "import h5py, sys
for p in sys.argv[1:]:
    with h5py.File(p, 'r') as f: print(p, 'carried:', f.attrs['tokens_blake2b'], f.attrs['settings'])" results/corpus/*.h5
fi
# A variant's overlay files: NAME is bench/ablation/NAME.yaml, and A+B is A's then B's (so that each variant of a
# chain can carry its own extra, e.g. live_uv_bsigns_wide+embedding_q2tp), then ABLATION_EXTRA's.
overlays() {
  local IFS=+ part
  for part in $1; do printf 'bench/ablation/%s.yaml ' "$part"; done
  printf '%s' "${ABLATION_EXTRA:-}"
}
# Variant $1's Snakemake in the current folder (its copy), on GPU $2 with $3 cores and any further arguments, appended to
# snakemake.log; `run` and `chain` both use it.
variant_snakemake() {
  CUDA_VISIBLE_DEVICES=${2//[a-z]/} snakemake --cores "${ABLATION_CORES:-$3}" ${RUN_TARGETS:-results/model.cmf results/eval.json} \
    $TRIGGERS --quiet rules --configfile $BASE $(overlays "$1") "${@:4}" >> snakemake.log 2>&1
}
# ABLATION_DEADLINE_S (seconds from `start`; what is left of the session's device time, less a margin for the last
# collect): each variant of the chain runs the stages before train_student, then trains only the epochs that end,
# evaluation included, before it (bench/fit_epochs.py at ABLATION_STEP_S seconds a step, default 0.33, the GPU recipe's
# on an H100, and ABLATION_TAIL_S beside the steps, default 150: the first step's compile, the evaluations, evaluate),
# never more than its own; a variant where not one epoch fits is not trained. ABLATION_LATE_STEP_S: the step time
# after `train.hidden_epochs` (the teacher read back, not run), where it differs. Session 61 lost a run 354 steps from its
# end to a machine whose stages before the training were 25 % slower than the plan's.
variant_fit_epochs() {
  [[ -n ${ABLATION_DEADLINE:-} ]] || return 0
  variant_snakemake "$1" "$2" 16 --omit-from train_student
  python bench/fit_epochs.py --configs $BASE $(overlays "$1") --windows results/data/windows.h5 \
    --seconds-left $(( ABLATION_DEADLINE - $(date +%s) )) --step-s "${ABLATION_STEP_S:-0.33}" --tail-s "${ABLATION_TAIL_S:-150}" \
    ${ABLATION_LATE_STEP_S:+--late-step-s "$ABLATION_LATE_STEP_S"} \
    --out epochs_fit.yaml >> snakemake.log 2>&1 || return 1
  ABLATION_EXTRA="${ABLATION_EXTRA:-} epochs_fit.yaml"
}
# The finished student's extra loss by the teacher's entropy (bench/excess_by_entropy.py, seconds on the GPU), where
# the variant got that far.
variant_excess() {
  [[ -e results/eval.json ]] || return 0
  CUDA_VISIBLE_DEVICES=${1//[a-z]/} python bench/excess_by_entropy.py --teacher results/teacher.cmf --student results/model.cmf \
    --windows results/data/windows.h5 --ood-tokens 16384 --batch 16 --out excess.json > excess.log 2>&1 || true
}
# What comes back of a variant: its Snakemake log, job logs, stage times, eval.json, training metrics and the split.
VARIANT_FILES="snakemake.log logs benchmarks results/eval.json results/train/metrics.jsonl excess.json excess.log"
case $1 in
prefix)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  python -c "import torch, transformers, snakemake; print('torch', torch.__version__, 'transformers', transformers.__version__, 'snakemake', snakemake.__version__)" | tee -a "$OUT/gpu.txt"
  CUDA_VISIBLE_DEVICES=0 snakemake --cores 16 ${PREFIX_TARGETS:-results/student/encoded.cmf results/teacher/topk.0.h5} \
    $TRIGGERS --quiet rules --configfile $BASE 2>&1 | tail -20
  tar czf "$OUT/prefix.tgz" logs benchmarks
  ;;
run)
  shift
  # GPU_TESTS (a pytest -k expression, or "all") runs bench/gpu_tests.sh beside the variants, waited for with them
  if [[ -n ${GPU_TESTS:-} ]]; then
    expr=$GPU_TESTS; [[ $expr == all ]] && expr=""
    bash bench/gpu_tests.sh "${GPU_TESTS_LIMIT_S:-300}" "$expr" > "$OUT/gpu_tests.txt" 2>&1 &
  fi
  for spec in "$@"; do
    name=${spec%%:*}; gpu=${spec#*:}; [[ $gpu == "$spec" ]] && gpu=0
    dir=/root/ablation/$name
    [[ -d $dir ]] || { mkdir -p /root/ablation && cp -a "$PWD" "$dir"; }
    ( set +e; cd "$dir"; start=$(date +%s)
      # A Snakemake killed at the last call's limit leaves its lock, which fails this call at once (session 23
      # lost a call so); no other Snakemake runs in this copy. (A job it was killed in is left marked
      # incomplete: Snakemake then asks for --rerun-incomplete, or --cleanup-metadata once its log says it wrote.)
      snakemake --unlock --configfile $BASE $(overlays "$name") > /dev/null 2>&1
      # Snakemake leads its own process group, so that at the limit SIGINT reaches its jobs too, as a terminal's
      # Ctrl-C does: train_student ends its step, saves its state and stops (the next call resumes there with
      # nothing lost), and Snakemake, which waits for its jobs, then exits; 25 s later the group is killed.
      export -f variant_snakemake overlays; export BASE TRIGGERS
      setsid bash -c 'variant_snakemake "$@"' _ "$name" "$gpu" 8 &
      smk=$!
      ( sleep "${ABLATION_LIMIT_S:-540}"; kill -INT -- -$smk; sleep 25; kill -KILL -- -$smk ) > /dev/null 2>&1 &
      watchdog=$!
      wait $smk; status=$?
      pkill -P $watchdog 2> /dev/null; kill $watchdog 2> /dev/null
      echo "$name: exit $status after $(( $(date +%s) - start )) s" >> "$dir/snakemake.log"
      variant_excess "$gpu"
      tar czf "$OUT/${name//+/__}.tgz" $VARIANT_FILES 2>/dev/null || true ) &
  done
  wait
  for spec in "$@"; do tail -1 "/root/ablation/${spec%%:*}/snakemake.log"; done
  [[ -z ${GPU_TESTS:-} ]] || cat "$OUT/gpu_tests.txt"
  ;;
start)
  # The variants one after another, from the teacher to eval.json, in a process that outlives the device call
  # (setsid): the machine keeps training between calls while it stays warm, so no call ends in a stopped step, a
  # resume and a recompile, and no step waits for the next call (sessions 24-26 lost their prefix to the gap
  # between two calls). Each later variant starts from a copy of the first one's folder (its prefix; Snakemake's
  # params trigger retrains what its overlay changes; the first one's training, eval.json and split are left out, so
  # that a later variant that stops early sends back none of them as its own). `collect` brings back what is done.
  # Variants on different GPUs (NAME:0 NAME:1 on nvidia-h200-x2) are separate chains side by side, one per GPU;
  # NAME:0,1 is one variant on both (with bench/ablation/gpus2.yaml, train_student under torchrun). A chain that
  # outlasts the call it starts in needs the next `collect` call within the 30 s the machine stays warm: session 34
  # lost two chains to later calls, so plan a variant to end inside the call that starts it.
  # ABLATION_FROM=OTHER: the first variant, too, starts from a copy of variant OTHER's folder, without its training
  # (session 50's chain lost its training to a failing option after an eight-minute prefix, and went on so).
  # A GPU with a letter (NAME:0b) is another chain on that GPU, beside one still running (which `start` keeps): where
  # the step is host-bound (train_student's one Python thread at 98 % of a core, session 50), a second training on
  # the same GPU uses what the first leaves idle. The GPU's work for 32 x 1024 tokens was 163 ms in session 37's
  # profile (docs/benchmarks.md): about 0.16 s of the step's 0.29 at 32 windows, 0.33 of its 0.41 at 64. Start it once the first one's prefix is
  # done, from that folder: ABLATION_FROM=FIRST bash bench/ablation.sh start SECOND:0b. Not yet run on the device.
  shift
  mkdir -p /root/chain  # not /root/out: the device's $OUT is emptied at each call's start (session 27 lost chain.log so)
  running=$(for g in $(cat /root/chain/gpus 2>/dev/null); do [[ -e /root/chain/chain.$g.done ]] || echo "$g"; done | xargs)
  # an ended chain's marks: `collect` would take this one for ended
  [[ -n $running ]] || rm -f /root/chain/*.done /root/chain/*.tgz
  gpus=$(for spec in "$@"; do gpu=${spec#*:}; [[ $gpu == "$spec" ]] && gpu=0; echo "${gpu//,/-}"; done | sort -u)
  for gpu in $gpus; do
    [[ " $running " != *" $gpu "* ]] || { echo "GPU $gpu's chain is still running: name another (${gpu}b) to run beside it" >&2; exit 1; }
  done
  echo $running $gpus > /root/chain/gpus
  [[ -z ${ABLATION_DEADLINE_S:-} ]] || export ABLATION_DEADLINE=$(( $(date +%s) + ABLATION_DEADLINE_S ))
  for gpu in $gpus; do
    specs=(); for spec in "$@"; do g=${spec#*:}; [[ $g == "$spec" ]] && g=0; [[ ${g//,/-} == "$gpu" ]] && specs+=("$spec"); done
    # bash reads a script as it runs it: the next call's checkout, or the next chain's start, may replace this one
    cp bench/ablation.sh "/root/chain/ablation.$gpu.sh"
    # file names without ',' (GPU list 0,1: one variant on both GPUs), which the device does not send back
    CHAIN_GPU=$gpu setsid nohup bash "/root/chain/ablation.$gpu.sh" chain "${specs[@]}" > "/root/chain/chain.$gpu.log" 2>&1 < /dev/null &
    echo $! > "/root/chain/chain.$gpu.pid"  # setsid: the chain leads its own process group, Snakemake's jobs in it
    echo "started on GPU $gpu: ${specs[*]}"
  done
  ;;
chain)
  shift
  first=${1%%:*}
  for spec in "$@"; do
    name=${spec%%:*}; gpu=${spec#*:}; [[ $gpu == "$spec" ]] && gpu=0
    dir=/root/ablation/$name
    if [[ ! -d $dir ]]; then
      mkdir -p /root/ablation
      from=${ABLATION_FROM:-}; [[ $name != "$first" ]] && from=$first
      if [[ -n $from ]]; then cp -a "/root/ablation/$from" "$dir" && rm -rf "$dir/results/train" "$dir/results/eval.json" "$dir"/excess.* "$dir/logs/train_student.log" \
        "$dir/snakemake.log" "$dir/epochs_fit.yaml"  # the log is appended to: this variant's own from here
      else cp -a "$PWD" "$dir"; fi
    fi
    # this call's overlays: a folder made in an earlier call lacks an overlay added since (session 36 lost a call so)
    cp bench/ablation/*.yaml "$dir/bench/ablation/" || true
    ( set +e; cd "$dir"; start=$(date +%s)
      snakemake --unlock --configfile $BASE $(overlays "$name") > /dev/null 2>&1
      if variant_fit_epochs "$name" "$gpu"; then variant_snakemake "$name" "$gpu" 16; else false; fi
      echo "$name: exit $? after $(( $(date +%s) - start )) s" | tee -a snakemake.log
      variant_excess "$gpu"
      # written aside, then renamed: `collect` sends archives while the chain runs, never a half-written one
      tar czf "/root/chain/${name//+/__}.tgz.part" $VARIANT_FILES 2>/dev/null
      mv "/root/chain/${name//+/__}.tgz.part" "/root/chain/${name//+/__}.tgz" )
  done
  touch "/root/chain/chain.${CHAIN_GPU:-0}.done"
  ;;
stop)
  # `stop GPU`: that chain ends now, Snakemake and its jobs with it (train_student saves its state at the step it stops, as at the call limit), and
  # `collect` no longer waits for it; e.g. a second chain beside another (0b) that slows the first past its time.
  kill -- -"$(cat "/root/chain/chain.$2.pid")" 2>/dev/null || true
  touch "/root/chain/chain.$2.done"
  echo "stopped the chain on GPU $2"
  ;;
collect)
  # Wait up to $2 seconds for every chain to end, then send back every finished variant's archive, the chains' logs
  # and the running variants' logs and metrics so far. A machine without the chains (a fresh one: the held one went
  # back between calls, session 29) says so at once instead of waiting out the call's device time.
  # Each finished variant's archive goes to $OUT as soon as it exists, not at the end: a call killed at its limit
  # still brings back what finished (session 35 lost a finished-in-time variant to a `collect` that waited past the
  # call's 600 s). Give the wait as what is left of the call: begin the call
  # with `T0=$(date +%s);` and end it with `collect $((T0 + 570 - $(date +%s)))` (any POSIX shell).
  # The machine goes back after 30 s idle: answer "chain running" with the next `collect` at once and read the
  # archives afterwards (session 47 lost a six-epoch run's evaluation, its training done, to a pause between calls).
  # Each running variant's last line says where it is, to size that next wait.
  [[ -e /root/chain/gpus ]] || { echo "no chain on this machine (a fresh machine? start it again)" >&2; exit 1; }
  all_done() { local gpu; for gpu in $(cat /root/chain/gpus); do [[ -e /root/chain/chain.$gpu.done ]] || return 1; done; }
  send_finished() { cp -u /root/chain/*.tgz /root/chain/chain.*.log "$OUT/" 2>/dev/null || true; }
  for (( t = 0; t < ${2:-540}; t += 5 )); do send_finished; all_done && break; sleep 5; done
  send_finished
  tail -n 5 /root/chain/chain.*.log
  for dir in /root/ablation/*/; do
    name=$(basename "$dir"); name=${name//+/__}  # the device sends back no file whose name holds a '+'
    [[ -e /root/chain/$name.tgz ]] && continue
    ( cd "$dir" && tar czf "$OUT/$name-running.tgz" snakemake.log logs benchmarks results/train/metrics.jsonl 2>/dev/null ) || true
    echo "$(basename "$dir"): last rule done $(grep -ho 'Rule: [a-z_]*' "$dir/snakemake.log" 2>/dev/null | tail -n 1 | cut -c7-)," \
      "training $(grep -ho 'step [0-9]*/[0-9]*' "$dir/logs/train_student.log" 2>/dev/null | tail -n 1)"
  done
  all_done && echo "chain done" || echo "chain running"
  ;;
corpus-out)
  mkdir -p "$OUT/corpus"
  for h in ${2:+/root/ablation/$2/}results/corpus/generated.*.h5; do gzip -1 -c "$h" | split -b 15M - "$OUT/corpus/$(basename "$h").gz."; done
  du -h "$OUT"/corpus/*
  ;;
esac
