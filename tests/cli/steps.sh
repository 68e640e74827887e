# Sourced by the tests/cli scripts that watch a training run's metrics.jsonl.

# The step rows a run has logged (rows with a loss; event rows have none).
steps_logged() {
  local n
  n=$(grep -c '"loss":' "$1/metrics.jsonl" 2> /dev/null) || true
  echo "${n:-0}"
}

# Waits until the run in folder $1 has logged $2 steps; fails the test after 120 s,
# showing the end of the run's output file $3 when given.
wait_for_steps() {
  for _ in $(seq 600); do
    [ "$(steps_logged "$1")" -ge "$2" ] && return 0
    sleep 0.2
  done
  echo "no $2 steps in $1 within 120 s"
  [ -n "${3:-}" ] && { echo "--- the end of $3:"; tail -n 60 "$3"; }
  exit 1
}
