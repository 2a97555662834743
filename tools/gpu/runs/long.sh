#!/usr/bin/env bash
# usage: tools/gpu/runs/long.sh NAME [kvedit bench long options ...]
#
# Issue 42's real-weights run on a GPU host the kit set up (docs/gpu.md, "The kit"):
# `kvedit bench long --preset real-gpu --json` plus the options given (e.g. --pool 0.4
# --budgets 1536,2048). Writes $OUT/NAME.json (the result), $OUT/NAME.ckpt.json (the arms
# finished so far, rewritten after each arm: what is left if the time limit stops it) and
# $OUT/NAME.log (the bench's log); prints the log's end and a summary.
# Environment: the kit's $HOME/env.sh (PYTHONPATH, the vLLM site, the model), then
# VLLM_USE_V2_MODEL_RUNNER=0 (in-engine budgets hook vLLM's V1 model runner) and
# PYTHONUNBUFFERED=1; the bench stops itself at LONG_TIMEOUT_S (default 570 s: a device call
# lasts at most 600 s). PROF=1 also samples each arm's EngineCore with py-spy (prof.sh).
set -uo pipefail
name=$1; shift
. "$HOME/env.sh"
export VLLM_USE_V2_MODEL_RUNNER=0 PYTHONUNBUFFERED=1
if [ "${PROF:-0}" = 1 ]; then
  bash "$(dirname "$0")/prof.sh" "$name" & prof=$!
fi
timeout "${LONG_TIMEOUT_S:-570}" kvedit bench long --preset real-gpu --json \
  --checkpoint "$OUT/$name.ckpt.json" "$@" > "$OUT/$name.json" 2> "$OUT/$name.log"
rc=$?
if [ -n "${prof:-}" ]; then kill "$prof"; sleep 3; ls -la "$OUT" | grep engine; fi
tail -n 25 "$OUT/$name.log"
python3 - "$OUT/$name.json" <<'PY'
import json, sys
try:
    o = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit("no JSON result (stopped early?): see NAME.ckpt.json")
print("costs", json.dumps(o.get("costs")))
print("config differences", o.get("engine_configs", {}).get("differences"))
for r in o.get("frontier", []):
    print(r)
PY
exit $rc
