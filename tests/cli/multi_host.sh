#!/usr/bin/env bash
# Several hosts on one machine (tests/cli/hosts.sh: network and UTS namespaces
# on a bridge, Open MPI over TCP, remote daemons started through an rsh agent):
# every layout split across hosts trains as one process does (losses and the
# final parameters, fp32: 1e-5 relative, 1e-4 absolute as in the oracle tests), a checkpoint written across hosts
# resumes on one, a cut link ends the job within the watchdog timeout plus a
# bound, and a host lost under --max-restarts --min-ranks is left behind: the
# run ends on the host that remains with the uninterrupted run's losses.
# Skipped (77) where namespaces cannot be made (needs root).
set -euo pipefail
meshtrain=$1
python=$2
here=$(dirname "$0")
# shellcheck source=hosts.sh
source "$here/hosts.sh"
why=$(hosts_can_run) || { echo "skipped: $why"; exit 77; }
run=$(mktemp -d)
trap 'hosts_down; rm -rf "$run"' EXIT
hosts_up 3 "$run"

# A flat learning rate, so that a resumed run and an uninterrupted one agree step for step.
common=(--model.preset=tiny --model.layers=2 --training.batch=12 --training.micro_batch=1 --training.sample_tokens=0
        --training.lr=1e-3 --training.min_lr=1e-3 --training.warmup=0 --training.eval_every=0 --training.steps=9
        --checkpoint.every=3 --checkpoint.async=false)

# shellcheck source=same_as.sh
source "$here/same_as.sh"

train_on() {  # name, ranks, hostfile entries (host:slots ...), then -- and train's extra options
  local name=$1 ranks=$2
  shift 2
  local entries=()
  while [ "$1" != -- ]; do entries+=("$1"); shift; done
  shift
  hostfile "$run/$name.hosts" "${entries[@]}"
  on_host 1 "$meshtrain" run -n "$ranks" --hostfile "$run/$name.hosts" train "${common[@]}" "$@" \
    --run.out="$run/$name" > "$run/$name.log" 2>&1 || { echo "$name failed"; cat "$run/$name.log"; exit 1; }
}

"$meshtrain" train "${common[@]}" --run.out="$run/ref" > "$run/ref.log" 2>&1 || { cat "$run/ref.log"; exit 1; }

train_on dp 4 1:2 2:2 --
grep -q "on 4 ranks on 2 hosts (node1: 0-1, node2: 2-3)" "$run/dp.log" || { cat "$run/dp.log"; exit 1; }
same_as ref dp
train_on tp 2 1:1 2:1 -- --parallel.tp=2  # each tensor-parallel pair spans the two hosts
grep -q "on 2 ranks on 2 hosts (node1: 0, node2: 1)" "$run/tp.log" || { cat "$run/tp.log"; exit 1; }
same_as ref tp
train_on pp 2 1:1 2:1 -- --parallel.pp=2
same_as ref pp
train_on three 3 1:1 2:1 3:1 -- --parallel.zero_stage=3  # uneven shards over three hosts
grep -q "on 3 ranks on 3 hosts (node1: 0, node2: 1, node3: 2)" "$run/three.log" || { cat "$run/three.log"; exit 1; }
same_as ref three

# The checkpoint of step 6 written by four ranks on two hosts, resumed by one process.
mkdir -p "$run/one/checkpoints"
cp -r "$run/dp/checkpoints/step-00000006" "$run/one/checkpoints/"
echo step-00000006 > "$run/one/checkpoints/latest"
"$meshtrain" train "${common[@]}" --run.out="$run/one" > "$run/one.log" 2>&1 || { cat "$run/one.log"; exit 1; }
grep -q "resumed from .*step-00000006 at step 6" "$run/one.log" || { cat "$run/one.log"; exit 1; }
"$python" - "$run/ref/metrics.jsonl" "$run/one/metrics.jsonl" <<'PY'
import json, sys
rows = lambda path: {r["step"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r}
want, got = rows(sys.argv[1]), rows(sys.argv[2])
assert sorted(got) == [7, 8, 9], sorted(got)
for step in got:
    assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), f"step {step}: {got[step]} != {want[step]}"
PY

# shellcheck source=steps.sh
source "$here/steps.sh"

# A link cut mid-run: the watchdog fires on the host that remains, mpirun cannot finish aborting
# (it cannot reach node2), the launcher ends it; all within the timeout plus a bound.
hostfile "$run/cut.hosts" 1:2 2:2
on_host 1 env MESHTRAIN_COMM_TIMEOUT=5 MESHTRAIN_LAUNCHER_ABORT_S=3 "$meshtrain" run -n 4 --hostfile "$run/cut.hosts" \
  train "${common[@]}" --training.steps=100000 --checkpoint.every=0 --run.out="$run/cut" > "$run/cut.log" 2>&1 &
launcher=$!
wait_for_steps "$run/cut" 2
cut_link 2
cut=$(date +%s)
status=0
wait "$launcher" || status=$?
took=$(( $(date +%s) - cut ))
[ "$status" != 0 ] && [ "$took" -le 40 ] || { echo "status $status, $took s after the cut"; cat "$run/cut.log"; exit 1; }
grep -q "watchdog: .* it runs on node1; it waits for .*ranks 2-3 on node2" "$run/cut.log" || { cat "$run/cut.log"; exit 1; }
echo "a cut link ended the job (status $status) $took s after the cut (watchdog 5 s)"
hosts_down
hosts_up 2 "$run"

# A host lost mid-run (its link cut and every process on it killed): one restart, on the two ranks of node1.
hostfile "$run/lost.hosts" 1:2 2:2
on_host 1 env MESHTRAIN_HOST_PROBE_S=8 "$meshtrain" run -n 4 --hostfile "$run/lost.hosts" --max-restarts 1 --min-ranks 2 \
  train "${common[@]}" --run.out="$run/lost" > "$run/lost.log" 2>&1 &
launcher=$!
wait_for_steps "$run/lost" 4
kill_host 2
lost=$(date +%s%N)
for _ in $(seq 1200); do
  grep -q '"event":"restart"' "$run/lost/metrics.jsonl" && break
  kill -0 "$launcher" 2> /dev/null || break  # the launcher gave up: its status and log say why below
  sleep 0.1
done
echo "a lost host: training resumed on the other $(( ($(date +%s%N) - lost) / 1000000 )) ms after the kill (probe limit 8 s)"
status=0
wait "$launcher" || status=$?
[ "$status" = 0 ] || { echo "status $status after a host was lost"; cat "$run/lost.log"; exit 1; }
grep -q "lost host(s) 10.213.0.2: no process started there" "$run/lost.log" &&
  grep -q "^meshtrain:   10.213.0.2: " "$run/lost.log" &&
  grep -q "relaunching on 2 rank(s) (4 before) on 10.213.0.1:2" "$run/lost.log" &&
  grep -q "restart 1: resumed at step [36], .* on 2 ranks (4 before)" "$run/lost.log" || { cat "$run/lost.log"; exit 1; }
grep -q '"event":"restart","ranks":2,"ranks_before":4' "$run/lost/metrics.jsonl" || { cat "$run/lost/metrics.jsonl"; exit 1; }
same_as ref lost
hosts_down

# Local checkpoints (Note [Local checkpoints]): $run/local is each host's own disk.
hosts_up 2 "$run" "$run/local"
hostfile "$run/local.hosts" 1:2 2:2
local_run() {  # name, steps, more of run's or train's options
  local name=$1 steps=$2
  shift 2
  on_host 1 "$meshtrain" run -n 4 --hostfile "$run/local.hosts" train "${common[@]}" --parallel.zero_stage=3 \
    --checkpoint.local=true --checkpoint.dir="$run/local/ckpt" --training.steps="$steps" "$@" --run.out="$run/$name"
}
local_run zero3local 6 > "$run/local6.log" 2>&1 || { cat "$run/local6.log"; exit 1; }
[ "$(ls "$run/disk-node1/ckpt/step-00000006")" = "$(printf 'MANIFEST.json\nmetadata.json\nrank-00000.bin\nrank-00001.bin')" ] &&
  [ "$(ls "$run/disk-node2/ckpt/step-00000006")" = "$(printf 'MANIFEST.json\nmetadata.json\nrank-00002.bin\nrank-00003.bin')" ] || {
  ls -R "$run"/disk-node*; exit 1; }
local_run zero3local 9 > "$run/local9.log" 2>&1 || { cat "$run/local9.log"; exit 1; }
grep -q "resumed from $run/local/ckpt/step-00000006 at step 6" "$run/local9.log" || { cat "$run/local9.log"; exit 1; }
# On node1 alone the shards node2 wrote are missing: refused by name, with what to do.
status=0
on_host 1 "$meshtrain" run -n 2 train "${common[@]}" --parallel.zero_stage=3 --checkpoint.local=true \
  --checkpoint.dir="$run/local/ckpt" --run.out="$run/alone" > "$run/alone.log" 2>&1 || status=$?
[ "$status" = 1 ] && grep -q "are in files on other hosts (rank-0000[23].bin on node2.*meshtrain checkpoint gather" \
  "$run/alone.log" || { echo "status $status"; cat "$run/alone.log"; exit 1; }
# Gathered into one folder by a rank on each host: the parameters of the uninterrupted run.
on_host 1 "$meshtrain" run -n 2 --hosts 10.213.0.1:1,10.213.0.2:1 checkpoint gather "$run/local/ckpt" \
  --out "$run/gathered/checkpoints" > "$run/gather.log" 2>&1 || { cat "$run/gather.log"; exit 1; }
grep -q "gathered step-00000009 (step 9): [0-9]* files" "$run/gather.log" || { cat "$run/gather.log"; exit 1; }
cp "$run/zero3local/metrics.jsonl" "$run/gathered/"
same_as ref gathered
# The same in one process, from copies of both hosts' folders.
"$meshtrain" checkpoint gather "$run/disk-node1/ckpt/step-00000009" "$run/disk-node2/ckpt/step-00000009" \
  --out "$run/copies/checkpoints" > "$run/copies.log" 2>&1 || { cat "$run/copies.log"; exit 1; }
cp "$run/zero3local/metrics.jsonl" "$run/copies/"
same_as ref copies
status=0  # node1's copy alone: node2's files are named, nothing is written
"$meshtrain" checkpoint gather "$run/disk-node1/ckpt" --out "$run/half" > "$run/half.log" 2>&1 || status=$?
[ "$status" = 1 ] && grep -q "no rank holds rank-00002.bin (written on node2), rank-00003.bin (written on node2)" \
  "$run/half.log" && [ ! -e "$run/half/latest" ] || { echo "status $status"; cat "$run/half.log"; exit 1; }
# checkpoint.local on a folder the hosts share, and a shared checkpoint.dir on local disks: refused at start.
status=0
local_run sharedlocal 1 --checkpoint.dir="$run/sharedckpt" > "$run/sharedlocal.log" 2>&1 || status=$?
[ "$status" = 1 ] && grep -q "checkpoint.dir = $run/sharedckpt is shared between hosts (rank [0-3] on node[12] sees the file rank [0-3] on node[12] wrote there)" \
  "$run/sharedlocal.log" || { echo "status $status"; cat "$run/sharedlocal.log"; exit 1; }
status=0
on_host 1 "$meshtrain" run -n 4 --hostfile "$run/local.hosts" train "${common[@]}" --checkpoint.dir="$run/local/x" \
  --run.out="$run/notshared" > "$run/notshared.log" 2>&1 || status=$?
[ "$status" = 1 ] && grep -q "checkpoint.dir = $run/local/x is not shared: ranks 2-3 on node2 .*or set checkpoint.local = true" \
  "$run/notshared.log" || { echo "status $status"; cat "$run/notshared.log"; exit 1; }
compare_all
echo "ok: layouts across 2 and 3 hosts equal one process; a cut link ends the job; a lost host is left behind;" \
  "local checkpoints resume on their hosts and gather into one folder"
