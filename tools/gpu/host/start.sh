#!/usr/bin/env bash
# usage: start.sh GROUP
# Starts GROUP's job (job_GROUP.sh) in its own session (setsid: it outlives this device
# call, until the machine goes back), logging to $KIT/logs/GROUP.log, its stdin, stdout and
# stderr off the caller's (no pipe of the caller is held open). A job that is running or done
# is left alone; one that failed (or died without a status) is started again. Returns once the
# job has written its pid (run_job.sh does, first), so the job is seen running from then on.
# The job runs from its own copies in $KIT/jobs/GROUP (and the model's from a copy of kvedit's
# source), made in a new folder and renamed into place: neither a later call that refreshes
# the checkout nor the start of another group's job rewrites a script under a running job
# (bash reads a script as it runs it: one rewritten in place can end it silently).
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
jobdir=$KIT/jobs/$g
rm -rf "$jobdir.new" && mkdir -p "$jobdir.new"
cp "$HOST_DIR"/{lib.sh,kit_host.py,run_job.sh,"job_$g.sh"} "$jobdir.new/"
rm -rf "$jobdir" && mv "$jobdir.new" "$jobdir"
if [ "$g" = model ]; then   # the conversion runs kvedit: from a copy of this checkout's source
  rm -rf "$KIT/src.tmp" && mkdir -p "$KIT/src.tmp"
  cp -a "$REPO/kvedit" "$KIT/src.tmp/"
  rm -rf "$KIT/src" && mv "$KIT/src.tmp" "$KIT/src"
fi
: > "$KIT/logs/$g.log"
rm -f "$KIT/state/$g.pid" "$KIT/state/$g.rc"
if command -v setsid >/dev/null; then
  setsid bash "$jobdir/run_job.sh" "$g" </dev/null >>"$KIT/logs/$g.log" 2>&1 &
else   # the same through python: a new session, so the job outlives this call
  "$PY" -c 'import os, sys; os.setsid(); os.execvp("bash", ["bash", *sys.argv[1:]])' \
    "$jobdir/run_job.sh" "$g" </dev/null >>"$KIT/logs/$g.log" 2>&1 &
fi
# The job's own pid, from the job: whether setsid forked or not, and never a half-written file.
limit=$(( ${KIT_START_TIMEOUT_S:-120} * 10 )) tenths=0
until [ -f "$KIT/state/$g.pid" ] || [ -f "$KIT/state/$g.rc" ]; do
  [ "$tenths" -lt "$limit" ] || die "$g: no pid from its job in $((limit / 10)) s ($KIT/logs/$g.log)"
  sleep 0.1; tenths=$((tenths + 1))
done
pid=$(cat "$KIT/state/$g.pid" 2>/dev/null || true)
say "$g: started in the background (pid $pid, log $KIT/logs/$g.log)"
