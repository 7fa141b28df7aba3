#!/usr/bin/env bash
# One GPU call of the benchmark suites (docs/benchmarks.md), from the checkout's root:
#
#   BG_S=SECONDS bash bench/device_call.sh 'SUITE [RUN ARGS]' ['SUITE [RUN ARGS]' ...]   # start, then poll
#   bash bench/device_call.sh                                                              # poll again
#   e.g. BG_S=1500 bash bench/device_call.sh 'offload-7b-train-2gpu --budget-s 540 --series 2'
#
# 1. wheels: .whl/*.whl (DeepSpeed's pure-Python wheel, hjson, pydantic and its needs: ../shared notes on the GPU
#    machines) into /tmp/bench-site, once per machine; .whl/aio/{include,lib} (libaio.h and libaio.so from Debian's
#    libaio-dev and libaio1) let DeepSpeed build its async_io op for the NVMe suites where the image lacks them;
# 2. the items run one after the other, `python -m bench run SUITE --work /dev/shm/bench ARGS`, in a detached
#    process (setsid) on a copy of the checkout ($ROOT/src), for at most BG_S seconds: a suite outlasts one call;
# 3. this call, and each later one, waits up to POLL_S (550) seconds, then packs every file the suites wrote under
#    bench/results (and the log) into $OUT/results.tgz. Each call must start within the machine's warm window, or
#    the machine goes back and the background with it (what the last call packed stays good). Then, here:
#    tar xzf FILES_AT/results.tgz (from the checkout's root), python -m bench report SUITE, commit.
set -u
T0=$(date +%s)
ROOT=${ROOT:-/tmp/bench-bg}
OUT=${OUT:-$ROOT/out_local}
mkdir -p "$OUT" "$ROOT"

bg_running() { [ -f $ROOT/bg.pid ] && kill -0 "$(cat $ROOT/bg.pid)" 2>/dev/null; }
pack() {  # every result file newer than the start, with the log, into one archive
  [ -d $ROOT/src ] || return 0
  (cd $ROOT/src && find bench/results -newer $ROOT/started -type f -print0 | tar czf "$OUT/results.tgz" --null -T -)
  cp $ROOT/call.log "$OUT"/bench.log 2>/dev/null
}
poll() {
  local until=$((T0 + ${POLL_S:-550})) n=0
  while bg_running && [ "$(date +%s)" -lt $until ]; do  # a pack every 60 s: a call cut short still returns them
    [ $((n++ % 12)) = 0 ] && pack
    sleep 5
  done
  pack
  tail -n 30 $ROOT/call.log 2>/dev/null
  if bg_running; then echo "BACKGROUND RUNNING: call again now to poll"; else echo "BACKGROUND DONE"; fi
}

if [ "${BENCH_ITEMS:-0}" = 1 ]; then  # the detached process itself
  cd $ROOT/src || exit 1
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  SITE=/tmp/bench-site
  if [ ! -f $SITE/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE \
      .whl/*.whl && touch $SITE/.done || exit 1
  fi
  export PYTHONPATH=$SITE:$PWD
  # DeepSpeed 0.19's op builder cannot parse an arch with a letter suffix (9.0a, which CUDA images for Hopper set);
  # frod train refuses such a list for NVMe offload and names this fix
  [ -n "${TORCH_CUDA_ARCH_LIST:-}" ] && export TORCH_CUDA_ARCH_LIST=$(echo "$TORCH_CUDA_ARCH_LIST" | sed 's/\([0-9]\)[a-z]/\1/g')
  if [ -d .whl/aio ]; then
    A=$PWD/.whl/aio
    export CPATH=$A/include:${CPATH:-} LIBRARY_PATH=$A/lib:${LIBRARY_PATH:-} LD_LIBRARY_PATH=$A/lib:${LD_LIBRARY_PATH:-}
  fi
  for item in "$@"; do
    left=$((BG_S - ($(date +%s) - T0)))
    [ $left -gt 60 ] || { echo "== no time left for: $item"; continue; }
    echo "== python -m bench run $item ($(($(date +%s) - T0)) s in)"
    # shellcheck disable=SC2086  # the item's arguments are words
    timeout $left python3 -m bench run $item --work /dev/shm/bench || echo "== exit $? for: $item"
  done
  echo "== all done ($(($(date +%s) - T0)) s)"
  exit 0
fi

if [ -n "${BG_S:-}" ]; then
  bg_running && { echo "a background run is already going here: call again without BG_S to poll"; exit 1; }
  [ $# -gt 0 ] || { echo "no suite given: BG_S=SECONDS bash bench/device_call.sh 'SUITE [ARGS]' ..."; exit 2; }
  rm -rf $ROOT/src && cp -a . $ROOT/src && touch $ROOT/started || exit 1
  BENCH_ITEMS=1 setsid nohup bash bench/device_call.sh "$@" >$ROOT/call.log 2>&1 </dev/null &
  echo $! >$ROOT/bg.pid
  echo "background run started (pid $(cat $ROOT/bg.pid), up to $BG_S s)"
  sleep 10
elif [ ! -f $ROOT/bg.pid ]; then
  echo "no background run on this machine (it went back, or none was started)"
  exit 1
fi
poll
