#!/usr/bin/env bash
# One GPU call of the learnability study (docs/learn-study.md), from the checkout's root:
#
#   bash studies/device_call.sh 'GPU:RUN ARGS' ['GPU:RUN ARGS' ...]
#   e.g. bash studies/device_call.sh '0:--tasks facts64,arith' '1:--tasks facts256,facts1024'
#
# 1. wheels: .gpu/whl/*.whl (peft with FrodConfig, gguf) into /tmp/site, once per machine;
# 2. model: SmolLM2-135M-Instruct's GGUF travels in three parts (a call carries at most 64 MiB with the checkout),
#    .gpu/m1/part_aa, .gpu/m2/part_ab, .gpu/m3/part_ac, one per call; /tmp keeps them while the machine stays warm.
#    With all, it is joined, checked (md5) and converted to /tmp/ls/smol; else the call stops and names the part
#    the next call must carry;
# 3. tasks: generated into /tmp/ls/work (deterministic from their seed); with CHECK=1, every method briefly
#    on GPU 0 (`learn_study check`), the call stopping if one fails;
# 4. each item runs `python -m studies.learn_study run ARGS` on its GPU, resuming from the committed results
#    (studies/results/learn_study/records.tgz); items on different GPUs run at once, items on one GPU one after
#    the other (with one GPU, all in the given order). Each GPU's results are rewritten into $OUT/gpuN.tgz after
#    every unit and when it ends. Then, in the checkout (while the next call already runs, if the machine is
#    warm): python -m studies.learn_study merge --into studies/results/learn_study FILES_AT/gpu*.tgz; commit.
#
# Longer than one call (a 160-step run of stock PEFT FRoD takes most of one): BG_S=SECONDS starts the same items
# in a detached process for up to SECONDS, on a copy of the checkout ($ROOT/src), its results in $ROOT/bg. This
# call, and each `POLL=1 bash studies/device_call.sh` after it, waits up to POLL_S (560) seconds, then copies
# what the background has so far (gpuN.tgz, call.log) into $OUT. Each poll must start within the machine's
# warm window, or the machine goes back and the background with it (its last copied results stay good).
set -u
T0=$(date +%s)
LIMIT=${LIMIT_S:-570}  # seconds for this script; the call's own limit is 600
WORKERS=${WORKERS:-6}  # runs sharing one GPU
RECORDS=${RECORDS:-studies/results/learn_study/records.tgz}
ROOT=${ROOT:-/tmp/ls}
MD5=a1231443440b107ff29f02bdb38c9d0a  # SmolLM2-135M-Instruct.Q4_1.gguf (tests/support/realmodel.py)
OUT=${OUT:-$ROOT/out_local}
mkdir -p "$OUT" $ROOT

bg_running() { [ -f $ROOT/bg.pid ] && kill -0 "$(cat $ROOT/bg.pid)" 2>/dev/null; }
poll() {  # wait for the background (or this call's POLL_S), then hand its results to $OUT
  local until=$((T0 + ${POLL_S:-560})) n=0
  while bg_running && [ "$(date +%s)" -lt $until ]; do  # a copy every 30 s: a call cut short still returns them
    [ $((n++ % 6)) = 0 ] && cp -a $ROOT/bg/. "$OUT"/ 2>/dev/null
    sleep 5
  done
  cp -a $ROOT/bg/. "$OUT"/ 2>/dev/null
  tail -n 25 $ROOT/bg/call.log 2>/dev/null
  if bg_running; then echo "BACKGROUND RUNNING: poll again now (POLL=1)"; else echo "BACKGROUND DONE"; fi
}
if [ "${POLL:-0}" = 1 ]; then
  [ -f $ROOT/bg.pid ] || { echo "no background study on this machine (it went back, or none was started)"; exit 1; }
  poll
  exit 0
fi
if [ -n "${BG_S:-}" ]; then
  bg_running && { echo "a background study is already running here: poll it (POLL=1)"; exit 1; }
  rm -rf $ROOT/src $ROOT/bg && mkdir -p $ROOT/bg && cp -a . $ROOT/src || exit 1
  cd $ROOT/src || exit 1
  OUT=$ROOT/bg LIMIT_S=$BG_S BG_S='' setsid nohup bash studies/device_call.sh "$@" >/dev/null 2>&1 </dev/null &
  echo $! >$ROOT/bg.pid
  cd - >/dev/null || exit 1
  echo "background study started (pid $(cat $ROOT/bg.pid), up to $BG_S s)"
  sleep 20
  poll
  exit 0
fi
exec > >(tee -a "$OUT/call.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
left() { echo $((LIMIT - ($(date +%s) - T0))); }

SITE=${SITE:-/tmp/site}
if [ ! -f $SITE/.done ] && compgen -G ".gpu/whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE \
    .gpu/whl/*.whl && touch $SITE/.done || exit 1
fi
export PYTHONPATH=$SITE:$PWD
python3 -c 'import peft, torch, transformers; from peft import FrodConfig; print("peft", peft.__version__, "torch",
  torch.__version__, "transformers", transformers.__version__, "GPUs", torch.cuda.device_count())' || exit 1

if [ ! -f $ROOT/smol/config.json ]; then
  parts="m1/part_aa m2/part_ab m3/part_ac"
  for p in $parts; do [ -f .gpu/$p ] && cp .gpu/$p $ROOT/; done
  for p in $parts; do
    if [ ! -f $ROOT/${p#*/} ]; then
      echo "STAGED: $(cd $ROOT && ls part_* 2>/dev/null | tr '\n' ' '); NEXT CALL: carry .gpu/${p%/*} (and" \
        ".gpu/whl) while this machine is warm"
      exit 0
    fi
  done
  cat $ROOT/part_aa $ROOT/part_ab $ROOT/part_ac >$ROOT/smol.gguf
  [ "$(md5sum $ROOT/smol.gguf | cut -d' ' -f1)" = $MD5 ] || { echo "GGUF md5 mismatch"; rm -f $ROOT/part_*; exit 1; }
  python3 -m frod_ds.cli.convert_gguf convert --gguf $ROOT/smol.gguf --out $ROOT/smol --dtype float32 || exit 1
fi
[ -f $ROOT/work/.done ] || { python3 -m studies.learn_study gen --work $ROOT/work ${GEN_ARGS:-} && touch $ROOT/work/.done; } || exit 1
[ $# -gt 0 ] || { echo "STAGED: model, wheels and tasks ready; no items given, nothing run"; exit 0; }

if [ "${CHECK:-0}" = 1 ]; then  # every method briefly on GPU 0 first; nothing else runs if one fails
  CUDA_VISIBLE_DEVICES=0 python3 -m studies.learn_study check --model $ROOT/smol --work $ROOT/work \
    --out $ROOT/check || { echo "CHECK FAILED: no items run"; exit 1; }
fi
# a warm machine goes on from its own $ROOT/out (so the next call need not wait for this one's merge); the
# committed records fill in whatever it lacks
rm -rf $ROOT/res && mkdir -p $ROOT/res
if [ -f "$RECORDS" ]; then tar xzf "$RECORDS" -C $ROOT/res || exit 1; fi
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$NGPU" -ge 1 ] || { echo "no GPU"; exit 1; }
run_items() {  # GPU, then that GPU's items in order
  local gpu=$1 item minutes
  shift
  for item in "$@"; do
    minutes=$(python3 -c "print(round(($(left) - 25) / 60, 2))")
    # a unit starts only with learn_study's --min-study-minutes (2) left after the command's own start
    python3 -c "import sys; sys.exit(float('$minutes') < 2.5)" || { echo "GPU $gpu: no time left for: $item"; break; }
    echo "GPU $gpu: learn_study run ${item#*:} (--max-minutes $minutes)"
    # shellcheck disable=SC2086  # the item's arguments are words
    CUDA_VISIBLE_DEVICES=$gpu python3 -m studies.learn_study run --model $ROOT/smol --work $ROOT/work \
      --out $ROOT/out/gpu$gpu --resume-from $ROOT/res --pack "$OUT/gpu$gpu.tgz" --workers "$WORKERS" \
      --max-minutes "$minutes" ${item#*:} || echo "GPU $gpu: exit $? for: $item"
  done
}
pids=()
for g in $(seq 0 $((NGPU - 1))); do
  mine=()
  for item in "$@"; do
    want=${item%%:*}
    { [ "$want" = "$g" ] || { [ "$g" = $((NGPU - 1)) ] && [ "$want" -ge "$NGPU" ]; }; } && mine+=("$item")
  done
  [ ${#mine[@]} -gt 0 ] && { run_items "$g" "${mine[@]}" & pids+=($!); }
done
# a bare `wait` would also wait for the tee above, which waits for this shell: a hang when no item was given
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
ls -l "$OUT"
echo "call done in $(($(date +%s) - T0)) s"
