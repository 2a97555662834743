#!/usr/bin/env bash
# usage: recv.sh NN   (device call NN of `python tools/gpu/kit.py plan`)
# Checks part NN (carried in .gpu_kit/send/NN) against the manifest, moves it out of the
# checkout into $KIT/parts, rebuilds every file whose parts are all here, and starts the
# background job of each group that is now complete (once: a failed job is reported by
# ready.sh and started again by start.sh GROUP). Running it again is harmless.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ $# -eq 1 ] && [[ $1 =~ ^[0-9]+$ ]] || die "usage: recv.sh NN (the part number this call carries)"
REPO=$(cd "$HOST_DIR/../../.." && pwd)
kit_host receive "$((10#$1))" --repo "$REPO"
for g in $(kit_host complete-groups); do   # start each job once (start.sh GROUP retries one)
  if has_job "$g" && [ "$(job_state "$g")" = none ]; then bash "$HOST_DIR/start.sh" "$g"; fi
done
