#!/bin/bash
# The whole chain in one command: HJD → training → eval, each job starting only when the one before it
# succeeded (--dependency=afterok). Prints one line per job: "<stage> <job id>".
#   MODEL=/ckpt/llama-2-7b STORE=/shared/factors/llama2-7b DATA=/shared/data/cs170k RUN=/shared/runs/x \
#     RECIPE=recipes/llama2_7b_cs170k.yaml launch/slurm/pipeline.sh [training overrides key=value ...]
# MODEL: base checkpoint dir or Hub id; STORE: factor store to build; DATA: data_prep output (train.jsonl,
# eval/); RUN: training output_dir (eval writes RUN/eval). Relative paths are taken from the
# repository root, the jobs' working directory. Optional: HJD_ARGS, EVAL_ARGS (extra flags, split on spaces),
# TASKS (eval tasks, default all), and the cluster shape of submit.sh (NODES, GPUS_PER_NODE, TASKS_PER_NODE,
# CPUS_PER_TASK, PARTITION, TIME, LOG_DIR), applied to all three jobs.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export FROD_DS_HOME=${FROD_DS_HOME:-$(cd "$here/../.." && pwd)}
for var in MODEL STORE DATA RUN RECIPE; do
  if [ -z "${!var:-}" ]; then
    echo "error: set $var (usage: MODEL=... STORE=... DATA=... RUN=... RECIPE=... $0 [overrides])" >&2
    exit 2
  fi
done
cd "$FROD_DS_HOME"
if [ ! -f "$RECIPE" ]; then echo "error: RECIPE $RECIPE is not a file" >&2; exit 2; fi
if [ ! -f "$DATA/train.jsonl" ]; then echo "error: DATA $DATA has no train.jsonl (run data_prep build first)" >&2; exit 2; fi

submitted=()
cancel_submitted() {  # a failed submission leaves no half chain behind
  if [ ${#submitted[@]} -gt 0 ]; then
    scancel "${submitted[@]}" || true
    echo "error: submission failed; cancelled jobs ${submitted[*]}" >&2
  fi
}
trap cancel_submitted ERR

read -r -a hjd_args <<< "${HJD_ARGS:-}"
read -r -a eval_args <<< "${EVAL_ARGS:-}"
hjd=$(MODEL=$MODEL OUT=$STORE "$here/submit.sh" "$here/hjd.sbatch" "${hjd_args[@]}")
submitted+=("$hjd")
train=$("$here/submit.sh" --dependency="afterok:$hjd" "$here/train.sbatch" \
  "model.base=$MODEL" "model.factor_store=$STORE" "data.train=$DATA/train.jsonl" "output_dir=$RUN" "$@")
submitted+=("$train")
evaluation=$(CHECKPOINT=$RUN/adapter-final OUTPUT=$RUN/eval "$here/submit.sh" --dependency="afterok:$train" "$here/eval.sbatch" \
  "${eval_args[@]}")
trap - ERR
echo "hjd $hjd"
echo "train $train"
echo "eval $evaluation"
