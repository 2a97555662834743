#!/usr/bin/env bash
# The base site: msgspec, pyzmq and gguf into $KIT/base-site (tools/gpu/groups/base.txt),
# what the model's conversion needs; every later site goes on PYTHONPATH above it.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
install_site base "$KIT/base-site"
PYTHONPATH="$KIT/base-site" "$PY" -c 'import msgspec, zmq, gguf; print("base site imports")'
