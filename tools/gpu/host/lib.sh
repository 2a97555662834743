# Sourced by the kit's host scripts (bash, set -euo pipefail in each): where things live.
# KIT: the kit's folder outside the checkout (parts, files, sites, job state and logs).
KIT=${KIT:-$HOME/kit}
export KIT
HOST_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${KIT_PYTHON:-python3}          # the image's interpreter (the one with torch)
OPTIONAL_GROUPS=" kvpress "        # a failed job of these warns; the others fail ready.sh
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore

say() { echo "[kit] $*"; }
die() { echo "[kit] ERROR: $*" >&2; exit 1; }
kit_host() { "$PY" "$HOST_DIR/kit_host.py" --kit "$KIT" "$@"; }
# whether process $1 is alive: a zombie is not (where PID 1 does not reap orphans, one stays)
alive() {
  local stat
  [[ ${1:-} =~ ^[0-9]+$ ]] && kill -0 "$1" 2>/dev/null || return 1
  [ -r "/proc/$1/stat" ] || return 0          # no /proc: kill -0 is all there is
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }; [ "${stat%% *}" != Z ]   # the field after "(comm) " is the state
}
# state of a group's background job: none | running | done | failed. The job (run_job.sh)
# writes its pid and, last, its exit status, each renamed into place; the status is read again
# after the process is found gone, as the job may have ended between the two looks.
job_state() {
  local g=$1 s=$KIT/state
  if [ ! -f "$s/$g.rc" ] && [ -f "$s/$g.pid" ] && alive "$(cat "$s/$g.pid" 2>/dev/null)"; then
    echo running
  elif [ -f "$s/$g.rc" ]; then
    if [ "$(cat "$s/$g.rc")" = 0 ]; then echo done; else echo failed; fi
  else echo none; fi
}
has_job() { [ -f "$HOST_DIR/job_$1.sh" ]; }
# pip install the wheels of group $1 into the folder $2, replacing it whole
install_site() {
  local g=$1 site=$2
  kit_host files "$g" > "$KIT/state/$g.files"
  mapfile -t wheels < "$KIT/state/$g.files"
  say "$g: pip install of ${#wheels[@]} wheels into $site"
  rm -rf "$site.tmp"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site.tmp" "${wheels[@]}"
  rm -rf "$site"
  mv "$site.tmp" "$site"
}
