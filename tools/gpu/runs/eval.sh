#!/usr/bin/env bash
# usage: tools/gpu/runs/eval.sh NAME LENGTH SEEDS [kvedit eval options ...]
#
# Issue 43's accuracy-at-length run on a GPU host the kit set up (docs/gpu.md, "The kit";
# docs/eval.md, "On a GPU"): `kvedit eval` of the real model at LENGTH tokens over SEEDS
# (e.g. 0,1,2: rounds go sample by sample across every seed, so a deadline leaves each seed
# the same number of samples), the policies of $POL (default below: reuse with repair first,
# then the query-agnostic scorers uniform and head-adaptive, the question-aware ones last),
# kvpress beside on the same prompts (the kit's site). Writes $OUT/NAME/ (results.json,
# samples.jsonl, kvpress_samples.jsonl) and $OUT/NAME.log; prints the figures' summary.
# Environment: the kit's $HOME/env.sh (PYTHONPATH, the vLLM and kvpress sites, the model);
# EVAL_DEADLINE_S (default 450) bounds the run, `timeout` 30 s after it. The accuracy phase
# gets 70% of it (kvpress the rest): on an H100 ~45 of a seed's 70 prompts; options after
# SEEDS pass through, e.g. `--sample-offset 9` for a later call to finish the seed.
set -uo pipefail
name=$1 length=$2 seeds=$3; shift 3
. "$HOME/env.sh"
export PYTHONUNBUFFERED=1
TASKS=${TASKS:-passkey,multikey,multivalue,multikey_confusable,docqa}
POL=${POL:-repair:base=keydiff,repair:base=keydiff:per_head=on,keydiff,keydiff:per_head=on,\
keydiff:per_head=on:budget=layer,kvzip,expected_attention:per_head=on,\
expected_attention:per_head=on:budget=layer,snapkv:per_head=on,\
snapkv:per_head=on:budget=layer,kvzip:per_head=on}
deadline=${EVAL_DEADLINE_S:-450}
timeout $((deadline + 30)) kvedit eval --model qwen2.5-coder-1.5b --lengths "$length" \
  --seeds "$seeds" --samples "${SAMPLES:-14}" --tasks "$TASKS" --policies "$POL" \
  --ratios 0.5,0.75 --no-gain --cells-at-once 4 \
  --reference kvpress --reference-site "$KVEDIT_KVPRESS_SITE" --reference-share 0.3 \
  --deadline-s "$deadline" --json --no-progress --out "$OUT/$name" "$@" \
  > "$OUT/$name.json" 2> "$OUT/$name.log"
rc=$?
tail -n 30 "$OUT/$name.log"
python3 - "$OUT/$name/results.json" <<'PY'
import json, sys
try:
    o = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit("no results.json (stopped early?)")
print("progress", json.dumps(o.get("progress")))
for k in ("acceptance", "checks"):
    if k in o:
        print(k, json.dumps(o[k])[:3000])
PY
exit $rc
