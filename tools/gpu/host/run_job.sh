#!/usr/bin/env bash
# usage: run_job.sh GROUP   (started by start.sh in a session of its own, from the job's own
# copies in $KIT/jobs/GROUP, its output appended to $KIT/logs/GROUP.log)
# Writes its pid to $KIT/state/GROUP.pid first, runs job_GROUP.sh, and always ends by
# writing the exit status to $KIT/state/GROUP.rc (last, renamed into place: present means
# finished): on success, on failure, on an error of this script, and on SIGTERM or SIGINT
# (128 + the signal, after passing SIGTERM on to the job). SIGHUP is ignored, by the job too.
# Only a SIGKILL leaves no status: then the pid names a dead process and ready.sh says none.
# The whole script is one { } block: bash reads all of it before running any of it.
{
set -euo pipefail
trap '' HUP
g=$1
KIT=${KIT:-$HOME/kit}
state=$KIT/state
start=$(date +%s) child="" rc=""
echo $$ > "$state/$g.pid.tmp" && mv -f "$state/$g.pid.tmp" "$state/$g.pid"
exec </dev/null >>"$KIT/logs/$g.log" 2>&1
finish() {
  trap - EXIT
  local code=${rc:-$1}
  echo "[kit] $g: exit $code after $(( $(date +%s) - start )) s"
  echo "$code" > "$state/$g.rc.tmp" && mv -f "$state/$g.rc.tmp" "$state/$g.rc"
}
stop() {   # the job's processes are in this shell's group (it leads its session: setsid)
  trap '' TERM INT
  rc=$((128 + $1))
  echo "[kit] $g: stopped by signal $1"
  kill -TERM -- "-$$" 2>/dev/null || { [ -z "$child" ] || kill -TERM "$child" 2>/dev/null; } || true
  exit "$rc"
}
trap 'finish $?' EXIT
trap 'stop 15' TERM
trap 'stop 2' INT
. "$(dirname "$0")/lib.sh"
bash "$HOST_DIR/job_$g.sh" &
child=$!
if wait "$child"; then rc=0; else rc=$?; fi
exit "$rc"
}
