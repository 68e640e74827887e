#!/usr/bin/env bash
# Measures the loop a developer and CI wait on, on this machine, and prints
# one table (docs/BENCHMARKS.md keeps the current one):
#   - set-up when everything is present (scripts/setup.sh --tests);
#   - a cold build: a fresh clone of HEAD, an empty compiler cache;
#   - a warm build: a second fresh clone in another folder, the cache the first filled;
#   - a rebuild after one library .cpp changed (a line appended to it);
#   - `ctest -L quick` and the whole suite at --parallel $(nproc), with the
#     ten slowest tests, and every test's time into WORK/test-times.txt
#     (the format of tests/test_costs.txt, which orders a fresh run).
#
#   bash scripts/times.sh [WORK]     (default WORK: a new folder under /tmp; kept)
#
# The clones are of the committed HEAD: commit before measuring. The first run
# of set-up on a fresh machine (apt and pip) is not repeated here; measure it
# on such a machine with `time bash scripts/main.sh`.
set -euo pipefail
root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=${1:-$(mktemp -d /tmp/meshtrain-times.XXXXXX)}
mkdir -p "$work"
work=$(cd "$work" && pwd)
edited=meshtrain/parallel/data_parallel.cpp

say() { printf 'times: %s\n' "$*" >&2; }
seconds() {  # seconds COMMAND...: runs it quietly (output in $work/last.log), prints its wall time
  local start=$SECONDS
  "$@" > "$work/last.log" 2>&1 || { cat "$work/last.log" >&2; say "failed: $*"; exit 1; }
  printf '%d' $((SECONDS - start))
}
set_up_and_build() { bash "$1/scripts/setup.sh" --tests && bash "$1/scripts/build.sh"; }

say "work folder $work"
setup=$(seconds bash "$root_dir/scripts/setup.sh" --tests)

export CCACHE_DIR="$work/ccache"
rm -rf "$work/cold" "$work/warm" "$CCACHE_DIR"
git clone -q "$root_dir" "$work/cold"
git clone -q "$root_dir" "$work/warm"
say "cold build (empty compiler cache)"
cold=$(seconds set_up_and_build "$work/cold")
say "warm build (another clone, the same commit)"
warm=$(seconds set_up_and_build "$work/warm")
echo "// a changed line" >> "$work/warm/$edited"
say "rebuild after a change to $edited"
rebuild=$(seconds bash "$work/warm/scripts/build.sh")
git -C "$work/warm" checkout -q -- "$edited"
bash "$work/warm/scripts/build.sh" > /dev/null

cd "$work/warm/build"
say "ctest -L quick"
quick=$(seconds ctest --parallel "$(nproc)" -L quick)
say "the whole suite"
start=$SECONDS
ctest --parallel "$(nproc)" > "$work/suite.log" 2>&1 || say "the suite failed (see $work/suite.log)"
suite=$((SECONDS - start))
sed -nE 's/^.*Test +#[0-9]+: ([^ ]+) [. ]*\**(Passed|Failed|Not Run|Skipped)[^0-9]*([0-9.]+) sec$/\1 \3/p' "$work/suite.log" |
  sort -k2 -rn > "$work/test-times.txt"

printf '\n| what | seconds |\n| --- | ---: |\n'
printf '| set-up, everything present | %s |\n' "$setup"
printf '| set-up and build, fresh clone, empty compiler cache | %s |\n' "$cold"
printf '| set-up and build, fresh clone in another folder, same commit built before | %s |\n' "$warm"
printf '| rebuild after one library .cpp changed (%s) | %s |\n' "$edited" "$rebuild"
printf '| `ctest -L quick` | %s |\n' "$quick"
printf '| whole suite, `ctest --parallel %s` | %s |\n' "$(nproc)" "$suite"
printf '\nslowest tests (seconds):\n'
head -10 "$work/test-times.txt" | awk '{ printf "  %-40s %6.1f\n", $1, $2 }'
printf '\n%s\n' "$(grep -E 'tests passed|tests failed' "$work/suite.log" || true)"
say "every test's time: $work/test-times.txt"
