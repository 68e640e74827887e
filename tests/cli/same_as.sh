# Sourced by tests that compare runs with a reference (tests/cli/compare_runs.py);
# needs $meshtrain, $python, $run and $here.
#
#   same_as REF NAME   run $run/NAME is to equal $run/REF: both exported now, compared by compare_all
#   compare_all        compares every pair so far (one Python start)

pairs=()
same_as() {
  local name
  for name in "$1" "$2"; do
    [ -d "$run/$name.hf" ] || "$meshtrain" export hf "$run/$name/checkpoints" --out "$run/$name.hf" > /dev/null
  done
  pairs+=("$run/$1" "$run/$2")
}

compare_all() { "$python" "$here/compare_runs.py" "${pairs[@]}"; }
