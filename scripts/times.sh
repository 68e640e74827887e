#!/usr/bin/env bash
# Measures the loop a developer and CI wait on, on this machine, and prints
# one table (docs/BENCHMARKS.md keeps the current one):
#   - set-up when everything is present (scripts/setup.sh --tests);
#   - set-up and build of a fresh clone of HEAD with an empty compiler cache;
#   - the same in a second fresh clone in another folder (the cache the first filled);
#   - a rebuild after one library .cpp changed (a declaration appended to it);
#   - `-L quick` and the whole suite as scripts/test.sh runs them, with the ten
#     slowest tests (every test's time: WORK/suite-times.txt).
# With --alone it then runs each test by itself and writes WORK/test_costs.txt,
# each test's seconds and the cores it kept busy (CPU seconds per second, in
# quarters): the table tests/test_costs.txt holds.
#
#   bash scripts/times.sh [--alone] [WORK]     (default WORK: a new folder under /tmp; kept)
#
# The clones are of the committed HEAD: commit before measuring. The first set-up
# on a fresh machine (apt and pip) is not repeated here: time `bash scripts/main.sh`
# on such a machine.
set -euo pipefail
root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
alone=false
if [ "${1:-}" = --alone ]; then alone=true; shift; fi
work=${1:-$(mktemp -d /tmp/meshtrain-times.XXXXXX)}
mkdir -p "$work"
work=$(cd "$work" && pwd)
edited=meshtrain/parallel/data_parallel.cpp
cores=$(nproc)

say() { printf 'times: %s\n' "$*" >&2; }
seconds() {  # seconds COMMAND...: runs it quietly (output in $work/last.log), prints its wall time
  local start=$SECONDS
  "$@" > "$work/last.log" 2>&1 || { cat "$work/last.log" >&2; say "failed: $*"; exit 1; }
  printf '%d' $((SECONDS - start))
}
set_up_and_build() { bash "$1/scripts/setup.sh" --tests && bash "$1/scripts/build.sh"; }
suite() { ctest --parallel "$cores" "$@"; }

say "work folder $work"
setup=$(seconds bash "$root_dir/scripts/setup.sh" --tests)

export CCACHE_DIR="$work/ccache"
rm -rf "$work/cold" "$work/warm" "$CCACHE_DIR"
git clone -q "$root_dir" "$work/cold"
git clone -q "$root_dir" "$work/warm"
say "fresh clone, empty compiler cache"
cold=$(seconds set_up_and_build "$work/cold")
say "another fresh clone, the same commit"
warm=$(seconds set_up_and_build "$work/warm")
# A line the compiler sees (a comment alone would be a preprocessed hit in the cache).
echo "static_assert(sizeof(int) > 0, \"a change at $(date +%s%N)\");" >> "$work/warm/$edited"
say "rebuild after a change to $edited"
rebuild=$(seconds bash "$work/warm/scripts/build.sh")
git -C "$work/warm" checkout -q -- "$edited"
bash "$work/warm/scripts/build.sh" > /dev/null

cd "$work/warm/build"
say "-L quick"
quick=$(seconds suite -L quick)
say "the whole suite"
rm -f Testing/Temporary/CTestCostData.txt  # as in a fresh clone: tests/test_costs.txt orders the run
start=$SECONDS
suite --output-on-failure > "$work/suite.log" 2>&1 || say "the suite failed (see $work/suite.log)"
whole=$((SECONDS - start))
sed -nE 's/^.*Test +#[0-9]+: ([^ ]+) [. ]*\**(Passed|Failed|Not Run|Skipped)[^0-9]*([0-9.]+) sec$/\1 \3/p' "$work/suite.log" |
  sort -k2 -rn > "$work/suite-times.txt"

printf '\n| what | seconds |\n| --- | ---: |\n'
printf '| set-up, everything present | %s |\n' "$setup"
printf '| set-up and build, fresh clone, empty compiler cache | %s |\n' "$cold"
printf '| set-up and build, fresh clone in another folder, same commit built before | %s |\n' "$warm"
printf '| rebuild after one library .cpp changed (%s) | %s |\n' "$edited" "$rebuild"
printf '| `-L quick` | %s |\n' "$quick"
printf '| whole suite | %s |\n' "$whole"
printf '\nslowest tests in the suite (seconds):\n'
head -10 "$work/suite-times.txt" | awk '{ printf "  %-40s %6.1f\n", $1, $2 }'
printf '\n%s\n' "$(grep -E 'tests passed|tests failed' "$work/suite.log" || true)"
say "every test's time in the suite: $work/suite-times.txt"

if $alone; then
  say "each test alone"
  : > "$work/alone.txt"
  for test in $(ctest -N | sed -nE 's/^ *Test +#[0-9]+: (.*)$/\1/p'); do
    /usr/bin/time -f "$test %e %U %S" -a -o "$work/alone.txt" ctest -R "^${test//./\\.}\$" > /dev/null 2>&1 ||
      say "$test failed alone"
  done
  {
    sed -n '/^#/p' "$root_dir/tests/test_costs.txt"
    awk -v most=$((4 * cores)) '{
      q = $2 > 0 ? int(4 * ($3 + $4) / $2 + 0.5) : 4; if (q < 1) q = 1; if (q > most) q = most
      printf "%s %.1f %g\n", $1, $2, q / 4 }' "$work/alone.txt" | sort -k2 -rn
  } > "$work/test_costs.txt"
  say "each test alone: $work/test_costs.txt (copy it to tests/test_costs.txt)"
fi
