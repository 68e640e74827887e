#!/usr/bin/env bash
# A full disk (Note [Failed saves], Note [Metrics lines]): a save the disk
# cannot hold is refused at its step with the bytes it needs and nothing
# written; the checkpoint before it is kept; a save that fails part-way (a
# file size limit) is reported at the next step with its partial files
# removed; metrics.jsonl on a full disk warns once and keeps whole lines
# while training goes on. Small disks are tmpfs mounts in a mount namespace
# of this script's own: skipped (77) where it cannot make one.
set -euo pipefail
meshtrain=$1
python=$2
if [ -z "${MESHTRAIN_IN_MOUNT_NS:-}" ]; then
  probe=$(mktemp -d)
  if ! unshare -m --propagation private mount -t tmpfs -o size=1m tmpfs "$probe" 2> /dev/null; then
    rmdir "$probe"; echo "skipped: needs a mount namespace with tmpfs mounts (unshare -m: run as root)"; exit 77
  fi
  rmdir "$probe"
  exec unshare -m --propagation private env MESHTRAIN_IN_MOUNT_NS=1 "$0" "$@"
fi
run=$(mktemp -d)
trap 'kill $(jobs -p) 2> /dev/null || true; umount "$run"/small* 2> /dev/null || true; rm -rf "$run"' EXIT
common=(--model.preset=tiny --model.layers=2 --training.batch=4 --training.micro_batch=2 --training.sample_tokens=0
        --training.eval_every=0)
small_disk() { mkdir -p "$run/$1" && mount -t tmpfs -o "size=$2" tmpfs "$run/$1"; }
expect_failure() {  # log, pattern...; the command before exited non-zero
  local log=$1; shift
  for pattern in "$@"; do grep -q -- "$pattern" "$log" || { echo "missing: $pattern"; cat "$log"; exit 1; }; done
  [ "$(grep -c 'error' "$log")" = 1 ] || { echo "said more than once:"; cat "$log"; exit 1; }
}

# A checkpoint (19.2 MiB on 2 ranks) on a 12 MiB disk: refused at step 2, nothing written.
small_disk small1 12m
status=0
"$meshtrain" run -n 2 train "${common[@]}" --training.steps=10 --checkpoint.every=2 --run.out="$run/a" \
  --checkpoint.dir="$run/small1/ck" > "$run/a.log" 2>&1 || status=$?
[ "$status" != 0 ] || { echo "a save that cannot fit passed"; cat "$run/a.log"; exit 1; }
expect_failure "$run/a.log" "cannot save checkpoint step 2: it needs 19.2 MiB in $run/small1/ck" \
  "MiB are free there: nothing was written" "set checkpoint.dir to a larger disk"
grep -q "step     3/10" "$run/a.log" && { echo "trained on past the failed save"; exit 1; }
[ "$(ls -A "$run/small1/ck")" = "LOCK" ] || { ls -la "$run/small1/ck"; exit 1; }

# Room for one: step 2 is saved, step 4 refused, step 2 kept as it was.
small_disk small2 30m
status=0
"$meshtrain" run -n 2 train "${common[@]}" --training.steps=10 --checkpoint.every=2 --checkpoint.keep=1 \
  --run.out="$run/b" --checkpoint.dir="$run/small2/ck" > "$run/b.log" 2>&1 || status=$?
[ "$status" != 0 ] || { cat "$run/b.log"; exit 1; }
expect_failure "$run/b.log" "cannot save checkpoint step 4: it needs 19.2 MiB"
[ "$(ls -A "$run/small2/ck" | sort | tr '\n' ' ')" = "LOCK latest step-00000002 " ] || { ls -la "$run/small2/ck"; exit 1; }
[ "$(cat "$run/small2/ck/latest")" = step-00000002 ]

# A save that fails part-way, in the background: said at the next step, partial files removed.
status=0
bash -c 'ulimit -f 6000; exec "$@"' - "$meshtrain" run -n 2 train "${common[@]}" --training.steps=10 \
  --checkpoint.every=4 --run.out="$run/c" > "$run/c.log" 2>&1 || status=$?
[ "$status" != 0 ] || { cat "$run/c.log"; exit 1; }
expect_failure "$run/c.log" "cannot write checkpoint file $run/c/checkpoints/.incomplete-step-00000004/rank-0000" \
  "File too large" "checkpoint step 4: it needs 19.2 MiB" "its partial files are removed"
# Said at the first step after the background save ends (step 5, or later on a slow machine), not at the next save.
grep -q "step     5/10" "$run/c.log" || { echo "the save's failure came before the step after it"; exit 1; }
grep -q "step     8/10" "$run/c.log" && { echo "the save's failure was not said before the next save"; exit 1; }
[ -z "$(ls -A "$run/c/checkpoints")" ] || { ls -la "$run/c/checkpoints"; exit 1; }

# metrics.jsonl on a disk that fills: one warning, whole lines, training goes on and saves elsewhere.
small_disk small3 2m
"$meshtrain" train "${common[@]}" --training.steps=100000 --checkpoint.every=1000 --run.out="$run/small3/d" \
  --checkpoint.dir="$run/d-checkpoints" > "$run/d.log" 2>&1 &
trainer=$!
for _ in $(seq 600); do grep -q '"step":3' "$run/small3/d/metrics.jsonl" 2> /dev/null && break; sleep 0.2; done
dd if=/dev/zero of="$run/small3/fill" bs=64k 2> /dev/null || true  # until the disk is full
for _ in $(seq 600); do grep -q "cannot write .*metrics.jsonl" "$run/d.log" && break; sleep 0.2; done
steps=$(grep -c "^step " "$run/d.log")
for _ in $(seq 600); do [ "$(grep -c "^step " "$run/d.log")" -ge $((steps + 3)) ] && break; sleep 0.2; done
kill -TERM "$trainer"
status=0
wait "$trainer" || status=$?
[ "$status" = 0 ] || { echo "status $status"; cat "$run/d.log"; exit 1; }
[ "$(grep -c "cannot write .*metrics.jsonl (No space left on device); metrics lines are lost" "$run/d.log")" = 1 ] || {
  cat "$run/d.log"; exit 1; }
"$python" -c 'import json, sys; [json.loads(l) for l in open(sys.argv[1])]' "$run/small3/d/metrics.jsonl"
grep -q "SIGTERM: stopped after step" "$run/d.log"
echo "ok: full disks refuse saves by their bytes, keep the last checkpoint, clean up, and keep metrics lines whole"
