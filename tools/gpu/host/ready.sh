#!/usr/bin/env bash
# usage: ready.sh   (the last device call of the plan runs it after recv.sh)
# Waits for the background jobs (at most KIT_READY_TIMEOUT_S, default 540 s), re-checks every
# file's sha256, prints the versions, nvidia-smi and each job's end, and writes
# $HOME/env.sh: source it (`. $HOME/env.sh`) before any kvedit command on this host.
# Exit 1 if a part is missing or a required job failed or is still running (run it again).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
REPO=$(cd "$HOST_DIR/../../.." && pwd)
timeout=${KIT_READY_TIMEOUT_S:-540}
kit_host status
kit_host all-parts
groups=$(kit_host complete-groups)
for g in $groups; do   # a group whose job never started (a call was skipped or re-ordered)
  if has_job "$g" && [ "$(job_state "$g")" = none ]; then bash "$HOST_DIR/start.sh" "$g"; fi
done
waited=0
while :; do
  pending=""
  for g in $groups; do
    if has_job "$g" && [ "$(job_state "$g")" = running ]; then pending="$pending $g"; fi
  done
  [ -n "$pending" ] && [ "$waited" -lt "$timeout" ] || break
  if [ $((waited % 20)) = 0 ]; then
    for g in $pending; do say "waiting for $g (${waited} s): $(tail -n 1 "$KIT/logs/$g.log" 2>/dev/null | cut -c1-150)"; done
  fi
  sleep 2; waited=$((waited + 2))
done
kit_host verify
failed=""; warn=""
for g in $groups; do
  has_job "$g" || continue
  st=$(job_state "$g")
  [ "$st" = done ] && continue
  if [ "$st" = none ] && [ -f "$KIT/state/$g.pid" ]; then   # only a SIGKILL leaves no status
    st="none (process $(cat "$KIT/state/$g.pid") ended without an exit status: killed?)"
  fi
  say "$g: $st; its log ($KIT/logs/$g.log) ends:"
  tail -n 15 "$KIT/logs/$g.log" 2>/dev/null | sed 's/^/    /' || true
  if [[ $OPTIONAL_GROUPS == *" $g "* ]]; then warn="$warn $g"; else failed="$failed $g"; fi
done
for f in "$KIT"/state/*.versions; do
  if [ -f "$f" ]; then say "$(cat "$f")"; fi
done
if command -v nvidia-smi >/dev/null; then nvidia-smi; else say "WARNING: no nvidia-smi here"; fi
if [ "$(job_state vllm)" = done ]; then
  mkdir -p "$KIT/bin"
  printf '#!/bin/sh\n# kvedit from the checkout on PYTHONPATH (set by $HOME/env.sh)\nexec python3 -m kvedit.cli "$@"\n' > "$KIT/bin/kvedit"
  chmod +x "$KIT/bin/kvedit"
  {
    echo "# Written by tools/gpu/host/ready.sh (kit $(kit_host id), $(date -u +%FT%TZ))."
    echo "# Source it before kvedit on this host: . \$HOME/env.sh"
    echo "if [ \"\${KVEDIT_KIT_ENV:-}\" != \"$KIT\" ]; then"
    echo "  export PYTHONPATH=\"$REPO:$KIT/vllm-site:$KIT/base-site:$KIT/stubs\${PYTHONPATH:+:\$PYTHONPATH}\""
    echo "  export PATH=\"$KIT/bin:$KIT/vllm-site/bin:\$PATH\" KVEDIT_KIT_ENV=\"$KIT\""
    echo "fi"
    echo "export KVEDIT_SRC=\"$REPO\""
    echo "export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0"
    echo "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
    if [ "$(job_state model)" = done ]; then echo "export KVEDIT_QWEN_DIR=\"$(cat "$KIT/state/model.dir")\""; fi
    if [ "$(job_state kvpress)" = done ]; then echo "export KVEDIT_KVPRESS_SITE=\"$KIT/kvpress-site\""; fi
  } > "$HOME/env.sh.tmp"
  mv "$HOME/env.sh.tmp" "$HOME/env.sh"
  say "wrote $HOME/env.sh:"; sed 's/^/    /' "$HOME/env.sh"
fi
[ -z "$warn" ] || say "WARNING: not ready:$warn (optional; its variable is left out of env.sh)"
[ -z "$failed" ] || die "not ready:$failed (a running job: run ready.sh again; a failed one: fix, then start.sh GROUP)"
say "ready"
