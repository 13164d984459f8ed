#!/usr/bin/env bash
# A stand-in for sbatch: usage submit.sh RULE GPU MEM_MB RUNTIME JOBSCRIPT. Records the request, starts the
# jobscript in the background and prints a job id. The first train_student job is stopped with SIGTERM once
# it has saved a training state, as SLURM stops a job at its time limit.
set -euo pipefail
rule=$1 gpu=$2 mem_mb=$3 runtime=$4 jobscript=$5
mkdir -p cluster
echo "$rule gpu=$gpu mem_mb=$mem_mb runtime=$runtime" >> cluster/submitted.txt
if [[ $rule == train_student && ! -e cluster/time-limit-hit ]]; then
  touch cluster/time-limit-hit
  (
    until grep -q "state saved at step" logs/train_student.log 2>/dev/null; do sleep 0.05; done
    for pid in $(pgrep -f "nvg.train_student"); do  # this workflow's job only, never another run's
      [[ $(readlink "/proc/$pid/cwd") == "$PWD" ]] && kill -TERM "$pid"
    done
  ) > /dev/null 2>&1 &
fi
nohup bash "$jobscript" > "cluster/$(basename "$jobscript").out" 2>&1 &
echo $!
