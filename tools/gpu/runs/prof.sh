#!/usr/bin/env bash
# usage: tools/gpu/runs/prof.sh NAME &   (long.sh starts it when PROF=1)
#
# Samples every vLLM EngineCore that starts while it runs (one per bench arm, in the arms'
# order) with py-spy, from the engine's start until it exits: $OUT/NAME.engineK.PID.txt in
# py-spy's raw (collapsed) format, with thread ids and idle samples, so that a step's whole
# wall time is in the file. tools/pyspy_shares.py reads them. The EngineCore runs the
# scheduler and (one GPU) the model runner in one process, so kvedit's per-step costs on both
# sides are in one profile.
# Environment: $PYSPY (default $HOME/py-spy: the binary of py-spy 0.4.3's wheel, which the
# caller copies there), PROF_RATE (default 97 Hz).
name=$1
spy=${PYSPY:-$HOME/py-spy}
seen=" "
k=0
while true; do
  for pid in $(pgrep -f 'VLLM::EngineCore' 2>/dev/null); do
    case "$seen" in *" $pid "*) continue ;; esac
    seen="$seen$pid "
    k=$((k + 1))
    "$spy" record --pid "$pid" --rate "${PROF_RATE:-97}" --nonblocking --idle --threads \
      --format raw --output "$OUT/$name.engine$k.$pid.txt" > "$OUT/$name.engine$k.log" 2>&1 &
  done
  sleep 1
done
