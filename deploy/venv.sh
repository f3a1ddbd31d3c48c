# Sourced by the quick-start scripts: make ./.venv hold sevendb and the extras named
# in SEVENDB_EXTRAS (default "server,dev,spark": the tests and the demo run nodes and Spark),
# reinstalling only when pyproject.toml changes. The caller's shell options are
# restored at the end (sourcing it from an interactive shell leaves no `set -e`).
_sevendb_caller_flags="$-"
_sevendb_caller_pipefail=0
if shopt -qo pipefail; then _sevendb_caller_pipefail=1; fi
set -euo pipefail
_sevendb_restore_opts() {
    case "$_sevendb_caller_flags" in *e*) ;; *) set +e ;; esac
    case "$_sevendb_caller_flags" in *u*) ;; *) set +u ;; esac
    if [ "$_sevendb_caller_pipefail" = 0 ]; then set +o pipefail; fi
    unset _sevendb_caller_flags _sevendb_caller_pipefail
    unset -f _sevendb_restore_opts
}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
extras="${SEVENDB_EXTRAS:-server,dev,spark}"
py="${PYTHON:-python3}"
if ! "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
    echo "sevendb needs Python 3.11 or newer; $py is $("$py" --version 2>&1)" >&2
    _sevendb_restore_opts
    return 1
fi
if [ ! -x "$venv/bin/python" ]; then
    echo "creating virtualenv $venv" >&2
    "$py" -m venv "$venv"
fi
stamp="$venv/.sevendb-installed"
want="$(cat "$root/pyproject.toml" | sha256sum | cut -d' ' -f1) $extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "installing sevendb[$extras] into $venv" >&2
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -e "$root[$extras]"
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
_sevendb_restore_opts
