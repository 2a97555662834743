#!/usr/bin/env bash
# usage: start.sh GROUP
# Starts GROUP's job (job_GROUP.sh) in its own session (setsid: it outlives this device
# call, until the machine goes back), logging to $KIT/logs/GROUP.log. A job that is running
# or done is left alone; one that failed is started again. The job runs from copies in
# $KIT/jobs (and the model's from a copy of kvedit's source), so a later call that refreshes
# the checkout cannot change a script under a running job.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ $# -eq 1 ] || die "usage: start.sh GROUP"
g=$1
REPO=$(cd "$HOST_DIR/../../.." && pwd)
if ! has_job "$g"; then say "$g: complete (no job)"; exit 0; fi
mkdir -p "$KIT/state" "$KIT/logs" "$KIT/jobs"
case $(job_state "$g") in
  done) say "$g: done"; exit 0 ;;
  running) say "$g: running (pid $(cat "$KIT/state/$g.pid"), log $KIT/logs/$g.log)"; exit 0 ;;
  failed) say "$g: failed before (exit $(cat "$KIT/state/$g.rc")), starting it again; its log ended:"
          tail -n 5 "$KIT/logs/$g.log" | sed 's/^/    /' || true
          rm -f "$KIT/state/$g.rc" ;;
esac
kit_host need "$g"
cp "$HOST_DIR"/lib.sh "$HOST_DIR"/kit_host.py "$HOST_DIR"/run_job.sh "$HOST_DIR/job_$g.sh" "$KIT/jobs/"
if [ "$g" = model ]; then   # the conversion runs kvedit: from a copy of this checkout's source
  rm -rf "$KIT/src.tmp" && mkdir -p "$KIT/src.tmp"
  cp -a "$REPO/kvedit" "$KIT/src.tmp/"
  rm -rf "$KIT/src" && mv "$KIT/src.tmp" "$KIT/src"
fi
: > "$KIT/logs/$g.log"
if command -v setsid >/dev/null; then
  setsid bash "$KIT/jobs/run_job.sh" "$g" </dev/null >/dev/null 2>&1 &
else   # the same through python: a new session, so the job outlives this call
  "$PY" -c 'import os, sys; os.setsid(); os.execvp("bash", ["bash", *sys.argv[1:]])' \
    "$KIT/jobs/run_job.sh" "$g" </dev/null >/dev/null 2>&1 &
fi
echo $! > "$KIT/state/$g.pid"
say "$g: started in the background (log $KIT/logs/$g.log)"
