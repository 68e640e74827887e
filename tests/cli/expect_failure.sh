#!/usr/bin/env bash
# expect_failure.sh "EXPECTED TEXT" COMMAND [ARGS...]
# Passes when COMMAND exits non-zero and its output contains EXPECTED TEXT.
expected=$1
shift
output=$("$@" 2>&1)
status=$?
if [ "$status" -eq 0 ]; then
  printf 'expected a failure, but it exited 0:\n%s\n' "$output"
  exit 1
fi
if ! grep -qF -- "$expected" <<<"$output"; then
  printf 'exit %s, but the output lacks "%s":\n%s\n' "$status" "$expected" "$output"
  exit 1
fi
printf 'ok: exit %s with "%s"\n' "$status" "$expected"
