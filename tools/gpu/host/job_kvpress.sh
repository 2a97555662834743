#!/usr/bin/env bash
# The kvpress site: kvpress 0.5.5 with the transformers < 5.3 it pins, in $KIT/kvpress-site,
# laid over the image's packages (never beside the vLLM site in one process); imported once.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
install_site kvpress "$KIT/kvpress-site"
versions=$(PYTHONPATH="$KIT/kvpress-site" "$PY" -c '
import torch, transformers, kvpress, importlib.metadata as m
print("kvpress %s, transformers %s, torch %s (kvpress site)" % (m.version("kvpress"),
      transformers.__version__, torch.__version__))')
echo "$versions" | tee "$KIT/state/kvpress.versions"
