#!/usr/bin/env bash
# Federated learning across processes: split a play by speaker, then a server
# under mutual TLS with an allowlist and secure aggregation, three clients (one
# vanishes after sending its shares), the server killed and restarted mid-run
# (it resumes, the clients rejoin), and clients the server must refuse.
set -euo pipefail
meshtrain=$1
here=$(cd "$(dirname "$0")" && pwd)
run=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$run"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
export OMP_NUM_THREADS=1

# --- data -------------------------------------------------------------------
"$meshtrain" fl split "$here/../data/shakespeare_excerpt.txt" --out "$run/speakers" --min-bytes 1000 > "$run/split.log"
grep -q "clients" "$run/split.log" || fail "split printed no summary"
[ -f "$run/speakers/val.bin" ] && [ -f "$run/speakers/MENENIUS/train.bin" ] || fail "by-speaker split files missing"
"$meshtrain" fl split "$here/../data/shakespeare_excerpt.txt" --out "$run/iid" --by iid --clients 3 \
  --data.val_fraction=0.25 > "$run/iid.log"
# data.val_fraction is a share of the text, as in train (whole speeches held out: near, not exact).
python3 -c 'import re, sys; t, v = map(int, re.search(r"(\d+) training bytes, (\d+) validation", sys.argv[1]).groups()); sys.exit(not 0.2 < v / (t + v) < 0.3)' \
  "$(cat "$run/iid.log")" || fail "fl split --data.val_fraction=0.25 held out another share: $(cat "$run/iid.log")"
"$meshtrain" fl split "$here/../data/shakespeare_excerpt.txt" --out "$run/dir" --by dirichlet --clients 3 --alpha 0.3 \
  --min-bytes 1 > /dev/null
[ "$(ls -d "$run"/iid/client*/ | wc -l)" = 3 ] || fail "iid split: expected 3 clients"

# --- certificates: one CA for the federation, another nobody trusts -----------
cert() {  # name ca_prefix
  openssl req -new -newkey rsa:2048 -nodes -keyout "$run/$1.key" -subj "/CN=$1" -out "$run/$1.csr" 2>/dev/null
  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$run/$1.ext"
  openssl x509 -req -in "$run/$1.csr" -CA "$run/$2.crt" -CAkey "$run/$2.key" -CAcreateserial -days 2 \
    -extfile "$run/$1.ext" -out "$run/$1.crt" 2>/dev/null
}
for ca in ca rogue; do
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$run/$ca.key" -subj "/CN=$ca" -days 2 -out "$run/$ca.crt" 2>/dev/null
done
cert localhost ca
for name in alice bob dave carol; do cert "$name" ca; done
cert mallory rogue

# --- the federation -------------------------------------------------------------
port=$("$meshtrain" fl server --help-config > /dev/null && python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
server_args=(fl server --fl.server.listen=127.0.0.1:$port --fl.server.cert="$run/localhost.crt"
  --fl.server.key="$run/localhost.key" --fl.server.client_ca="$run/ca.crt" --fl.server.mutual_tls=true
  '--fl.server.allow=["alice","bob","dave"]' --fl.server.out="$run/out" --fl.rounds=4 --fl.min_available=3
  --fl.min_fit=2 --fl.deadline_s=4 --fl.wait_clients_s=20 --fl.secagg.enabled=true --fl.secagg.threshold=2
  --fl.data.val_file="$run/speakers/val.bin" --model.layers=1 --model.width=32 --model.heads=2 --model.context=32
  --fl.client.local_steps=4 --fl.client.batch=4 --fl.client.lr=0.5)
"$meshtrain" "${server_args[@]}" > "$run/server1.log" 2>&1 &
server=$!
pids+=($server)
client() {  # id data extra...
  local id=$1 data=$2
  shift 2
  "$meshtrain" fl client --server "localhost:$port" --id "$id" --data "$data" --ca "$run/ca.crt" \
    --cert "$run/$id.crt" --key "$run/$id.key" --connect-timeout 60 "$@"
}
client alice "$run/speakers/MENENIUS" > "$run/alice.log" 2>&1 & pids+=($!)
client bob "$run/speakers/MARCIUS" > "$run/bob.log" 2>&1 & pids+=($!)
client dave "$run/speakers/COMINIUS" --drop-after share > "$run/dave.log" 2>&1 & pids+=($!)

# Refused: a certificate from another CA (the handshake fails), and a valid
# certificate whose name is not on the allowlist.
if "$meshtrain" fl client --server "localhost:$port" --id mallory --data "$run/speakers/MENENIUS" --ca "$run/ca.crt" \
  --cert "$run/mallory.crt" --key "$run/mallory.key" --connect-timeout 1 > "$run/mallory.log" 2>&1; then
  fail "a client with a certificate from another CA was admitted"
fi
grep -q "could not reach" "$run/mallory.log" || { cat "$run/mallory.log"; fail "mallory: no clear error"; }
if client carol "$run/speakers/MENENIUS" --connect-timeout 20 > "$run/carol.log" 2>&1; then
  fail "a client not on the allowlist was admitted"
fi
grep -q "not on the server's allow list" "$run/carol.log" || { cat "$run/carol.log"; fail "carol: no clear error"; }
# bob's certificate, another client's name.
if "$meshtrain" fl client --server "localhost:$port" --id alice --data "$run/speakers/MENENIUS" --ca "$run/ca.crt" \
  --cert "$run/bob.crt" --key "$run/bob.key" --connect-timeout 20 > "$run/impostor.log" 2>&1; then
  fail "a client joined under another client's name"
fi
grep -q "differs from its certificate's name" "$run/impostor.log" || { cat "$run/impostor.log"; fail "impostor: no clear error"; }

# Kill the server once round 1 is written (round 2 waits for dave, who is gone), restart it on the
# same port with a quorum of two.
for _ in $(seq 600); do
  grep -q '"round":1' "$run/out/metrics.jsonl" 2>/dev/null && break
  sleep 0.1
done
grep -q '"round":1' "$run/out/metrics.jsonl" || { cat "$run/server1.log"; fail "round 1 never finished"; }
sleep 0.3  # the state file is written right after the row
kill -9 $server
wait $server 2>/dev/null || true
"$meshtrain" "${server_args[@]}" --fl.min_available=2 > "$run/server2.log" 2>&1
grep -q "resumed from" "$run/server2.log" || { cat "$run/server2.log"; fail "the restarted server did not resume"; }
for pid in "${pids[@]:1}"; do wait "$pid" || true; done

python3 - "$run/out/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
rounds = [r["round"] for r in rows]
assert set(rounds) >= {0, 1, 2, 3, 4}, rounds
first = next(r for r in rows if r["round"] == 1)
assert first["status"] == "ok", first
assert "dave" in first["dropped"] and sorted(first["participants"]) == ["alice", "bob"], first
last = [r for r in rows if r["round"] == 4][-1]
assert last["status"] == "ok", last
assert last["val_loss"] < rows[0]["val_loss"], (rows[0]["val_loss"], last["val_loss"])
for r in rows[1:]:
    assert sum(c["up"] for c in r["bytes_per_client"].values()) == r["uplink_bytes"], r
print("fl: rounds", sorted(set(rounds)), "val loss", round(rows[0]["val_loss"], 3), "->", round(last["val_loss"], 3))
PY
grep -q "dropping out after share" "$run/dave.log" || fail "dave did not drop out"
grep -q "stopped by the server" "$run/alice.log" || { cat "$run/alice.log"; fail "alice was not stopped by the server"; }

# A client stopped with SIGTERM leaves the federation and exits 0.
"$meshtrain" fl server --fl.server.insecure=true --fl.rounds=1 --fl.min_available=2 --fl.wait_clients_s=30 \
  --fl.server.out="$run/leave" --model.layers=1 --model.width=32 --model.heads=2 --model.context=32 \
  --fl.server.listen=127.0.0.1:0 --port-file "$run/leave.port" > "$run/leave_server.log" 2>&1 &
leave_server=$!
pids+=($leave_server)
for _ in $(seq 100); do [ -s "$run/leave.port" ] && break; sleep 0.1; done
"$meshtrain" fl client --server "127.0.0.1:$(cat "$run/leave.port")" --insecure --id erin \
  --data "$run/speakers/MENENIUS" > "$run/erin.log" 2>&1 &
erin=$!
for _ in $(seq 100); do grep -q "erin' joined" "$run/leave_server.log" && break; sleep 0.1; done
kill -TERM $erin
wait $erin || fail "a client stopped with SIGTERM exited non-zero"
grep -q "left the federation" "$run/erin.log" || { cat "$run/erin.log"; fail "erin did not leave"; }
for _ in $(seq 50); do grep -q "erin' left" "$run/leave_server.log" && break; sleep 0.1; done
grep -q "erin' left" "$run/leave_server.log" || { cat "$run/leave_server.log"; fail "the server did not see erin leave"; }
kill $leave_server

# Plaintext is refused off loopback; the plot draws one line per file.
if "$meshtrain" fl server --fl.server.insecure=true --fl.server.listen=0.0.0.0:0 > "$run/insecure.log" 2>&1; then
  fail "plaintext on a public address was accepted"
fi
grep -q "loopback" "$run/insecure.log" || fail "no clear error for plaintext off loopback"
"$meshtrain" fl plot "$run/out/metrics.jsonl" "$run/out/metrics.jsonl" -o "$run/plot.svg" > /dev/null
[ "$(grep -c '<polyline' "$run/plot.svg")" = 2 ] || fail "plot: expected two lines"
echo "fl: ok"
