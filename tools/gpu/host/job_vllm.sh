#!/usr/bin/env bash
# The vLLM site: vLLM 0.26.0 and its side wheels into $KIT/vllm-site (over the base site); the import-only
# xgrammar stub in $KIT/stubs (vLLM 0.26 evaluates xgr.* annotations at import; structured
# output through xgrammar does not work with it); then vLLM is imported once, as it will be.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
install_site vllm "$KIT/vllm-site"
mkdir -p "$KIT/stubs/xgrammar"
printf 'def __getattr__(n):\n    if n.startswith("__"): raise AttributeError(n)\n    return type(n, (), {})\n' \
  > "$KIT/stubs/xgrammar/__init__.py"
versions=$(PYTHONPATH="$KIT/vllm-site:$KIT/base-site:$KIT/stubs" VLLM_USE_FLASHINFER_SAMPLER=0 \
  VLLM_USE_V2_MODEL_RUNNER=0 "$PY" -c '
import sys, torch, vllm, gguf, importlib.metadata as m
print("python %s, torch %s, vllm %s, transformers %s, gguf %s" % (sys.version.split()[0],
      torch.__version__, vllm.__version__, m.version("transformers"), m.version("gguf")))')
echo "$versions" | tee "$KIT/state/vllm.versions"
# The OpenAI server imports the most side wheels: say now, in the background, if one is short.
if PYTHONPATH="$KIT/vllm-site:$KIT/base-site:$KIT/stubs" VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0 \
   "$PY" -c 'import vllm.entrypoints.openai.api_server'; then
  echo "vllm.entrypoints.openai.api_server imports" | tee -a "$KIT/state/vllm.versions"
else
  echo "WARNING: vllm.entrypoints.openai.api_server does not import (traceback in $KIT/logs/vllm.log)" \
    | tee -a "$KIT/state/vllm.versions"
fi
