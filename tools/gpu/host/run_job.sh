#!/usr/bin/env bash
# usage: run_job.sh GROUP   (started by start.sh under setsid; runs from $KIT/jobs)
# Runs job_GROUP.sh with its output in $KIT/logs/GROUP.log and records its exit status in
# $KIT/state/GROUP.rc (written last, renamed into place: present means finished).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
g=$1
echo $$ > "$KIT/state/$g.pid"
start=$(date +%s)
if bash "$HOST_DIR/job_$g.sh" >> "$KIT/logs/$g.log" 2>&1; then rc=0; else rc=$?; fi
echo "[kit] $g: exit $rc after $(( $(date +%s) - start )) s" >> "$KIT/logs/$g.log"
echo "$rc" > "$KIT/state/$g.rc.tmp" && mv "$KIT/state/$g.rc.tmp" "$KIT/state/$g.rc"
