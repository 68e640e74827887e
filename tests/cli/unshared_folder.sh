#!/usr/bin/env bash
# A run folder one rank does not see (Note [Shared folders]): rank 1 runs in
# a mount namespace where run.out is a tmpfs of its own, as on a host that
# does not mount the shared file system. The run stops before training,
# naming the folder and the rank; the same run with every rank seeing it
# trains. Skipped (77) where mount namespaces cannot be made.
set -euo pipefail
meshtrain=$1
probe=$(mktemp -d)
if ! unshare -m --propagation private mount -t tmpfs -o size=1m tmpfs "$probe" 2> /dev/null; then
  rmdir "$probe"; echo "skipped: needs a mount namespace with tmpfs mounts (unshare -m: run as root)"; exit 77
fi
rmdir "$probe"
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
root=(); [ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
host=$(hostname)
args=(train --model.preset=tiny --model.layers=1 --training.steps=2 --training.batch=2 --training.micro_batch=1
      --training.sample_tokens=0 --run.out="$run/out")
mkdir -p "$run/out"
status=0
mpirun "${root[@]}" --oversubscribe -np 1 "$meshtrain" "${args[@]}" : -np 1 unshare -m --propagation private \
  sh -c 'mount -t tmpfs tmpfs "$0" && exec "$@"' "$run/out" "$meshtrain" "${args[@]}" > "$run/log" 2>&1 || status=$?
[ "$status" != 0 ] || { echo "a folder rank 1 cannot see was accepted"; cat "$run/log"; exit 1; }
grep -q "run.out = $run/out is not shared: rank 1 on $host cannot see the file rank 0 wrote there" "$run/log" || {
  cat "$run/log"; exit 1; }
grep -q "^step" "$run/log" && { echo "trained before the check"; exit 1; }
[ "$(grep -c "is not shared" "$run/log")" = 1 ] || { echo "said more than once"; cat "$run/log"; exit 1; }
ls -A "$run/out" | grep -q meshtrain-probe && { echo "the probe was left behind"; exit 1; }
mpirun "${root[@]}" --oversubscribe -np 2 "$meshtrain" "${args[@]}" > "$run/shared.log" 2>&1 || { cat "$run/shared.log"; exit 1; }
echo "ok: a folder a rank cannot see stops the run by name; a shared one trains"
