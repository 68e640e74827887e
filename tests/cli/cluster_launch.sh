#!/usr/bin/env bash
# meshtrain run on named hosts (here: this one by name, which is what a
# hostfile names): --hosts and --hostfile reach mpirun without
# --oversubscribe, so too few slots fail; MESHTRAIN_* variables are passed on
# with -x; ranks that disagree on them stop at once, naming the variable and
# where each value is seen (Note [Job environment]); train names its placement.
set -euo pipefail
meshtrain=$1
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
host=$(hostname)
root=(); [ "$(id -u)" = 0 ] && root=(--allow-run-as-root)

MESHTRAIN_COMM_TIMEOUT=77 "$meshtrain" run -n 2 --hosts "$host:2" selfcheck --bench-max-size 0 > "$run/hosts.log" 2>&1 ||
  { cat "$run/hosts.log"; exit 1; }
grep -q -- "--host $host:2 " "$run/hosts.log" && grep -q -- "-x MESHTRAIN_COMM_TIMEOUT" "$run/hosts.log" || {
  cat "$run/hosts.log"; exit 1; }
grep -q -- "--oversubscribe" "$run/hosts.log" && { echo "--oversubscribe hides missing slots"; exit 1; }
grep -q "checks: [0-9]* passed, 0 failed on 2 ranks" "$run/hosts.log" || { cat "$run/hosts.log"; exit 1; }

printf '%s slots=2\n' "$host" > "$run/hostfile"
"$meshtrain" run -n 2 --hostfile "$run/hostfile" train --model.preset=tiny --model.layers=1 --training.steps=1 \
  --training.batch=2 --training.micro_batch=1 --training.sample_tokens=0 --run.out="$run/a" > "$run/train.log" 2>&1 ||
  { cat "$run/train.log"; exit 1; }
grep -q "on 2 ranks on 1 host ($host: 0-1)" "$run/train.log" || { cat "$run/train.log"; exit 1; }

status=0  # the suite's environment allows oversubscription; a user's would not
env -u OMPI_MCA_rmaps_base_oversubscribe "$meshtrain" run -n 3 --hostfile "$run/hostfile" selfcheck --bench-max-size 0 > "$run/slots.log" 2>&1 || status=$?
[ "$status" != 0 ] && grep -q "not enough slots" "$run/slots.log" || { echo "status $status"; cat "$run/slots.log"; exit 1; }

status=0
"$meshtrain" run -n 2 --hostfile "$run/missing" selfcheck > "$run/missing.log" 2>&1 || status=$?
[ "$status" != 0 ] && grep -q "run --hostfile $run/missing: No such file" "$run/missing.log" || {
  cat "$run/missing.log"; exit 1; }

# Plain mpirun with a variable on one rank only.
status=0
env -u MESHTRAIN_COMM_TIMEOUT mpirun "${root[@]}" --oversubscribe -np 1 env MESHTRAIN_COMM_TIMEOUT=5 "$meshtrain" selfcheck --bench-max-size 0 : \
  -np 2 "$meshtrain" selfcheck --bench-max-size 0 > "$run/env.log" 2>&1 || status=$?
[ "$status" != 0 ] || { cat "$run/env.log"; exit 1; }
grep -q "the ranks disagree on their settings: MESHTRAIN_COMM_TIMEOUT is unset on ranks 1-2 ($host); '5' on rank 0 ($host)" \
  "$run/env.log" || { cat "$run/env.log"; exit 1; }
[ "$(grep -c "disagree" "$run/env.log")" = 1 ] || { echo "said more than once"; cat "$run/env.log"; exit 1; }
echo "ok: hosts and hostfiles reach mpirun, slots are enforced, settings are passed on and checked"
