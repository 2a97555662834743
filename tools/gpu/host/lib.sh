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
# state of a group's background job: none | running | done | failed
job_state() {
  local g=$1 s=$KIT/state
  if [ -f "$s/$g.rc" ]; then
    if [ "$(cat "$s/$g.rc")" = 0 ]; then echo done; else echo failed; fi
  elif [ -f "$s/$g.pid" ] && kill -0 "$(cat "$s/$g.pid")" 2>/dev/null; then echo running
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
