#!/usr/bin/env bash
# Installs what meshtrain needs on Debian 12, idempotently, once per machine:
#
#   setup.sh           what the main job needs: Debian packages (compiler, CMake, Ninja, ccache,
#                      Open MPI, CLI11, toml++, nlohmann-json, gRPC, protobuf, OpenSSL, GoogleTest,
#                      Google Benchmark, ...) and the Python packages of scripts/requirements/main.txt
#                      (the torch wheel, which carries libtorch, and pyarrow, which carries Arrow C++)
#   setup.sh --tests   and the packages the tests check against (requirements/test.txt), and
#                      Slurm and MUNGE for the tests' own cluster (their services are not configured)
#   setup.sh --bench   and the benchmarks' peers (requirements/bench.txt)
#
# The Python environment is kept per machine, outside the clone, keyed by what it pins:
# $MESHTRAIN_CACHE/venv-KEY (MESHTRAIN_CACHE defaults to ~/.cache/meshtrain), KEY a hash of
# python3's version and scripts/requirements/*.txt. A second clone reuses it; a change of pins
# makes a new one (the two most recently used are kept). .venv in the clone links to it.
# MESHTRAIN_VENV names a virtual environment to use instead. Runs as root or through sudo.
# When everything is present it changes nothing and takes about a second.
set -euo pipefail

root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
requirements="$root_dir/scripts/requirements"
stages=(main)
for arg in "$@"; do
  case "$arg" in
    --tests) stages+=(test) ;;
    --bench) stages+=(test bench) ;;
    *) printf 'setup: unknown option %s (expected --tests or --bench)\n' "$arg" >&2; exit 2 ;;
  esac
done

debian_packages=(
  g++ cmake ninja-build make pkg-config git ccache time
  libopenmpi-dev openmpi-bin iproute2
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libcpp-httplib-dev libsentencepiece-dev libpcre2-dev libutf8proc-dev liburing-dev fio
  zlib1g-dev libzstd-dev zstd
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libssl-dev openssl
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-venv python3-pip
)
# The tests' own Slurm cluster (tests/cli/slurm.sh): controller, node daemon, client, MUNGE.
test_debian_packages=(slurmctld slurmd slurm-client munge)

log() { printf 'setup: %s\n' "$*"; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    log "need root to run: $* (run this script as root or install sudo)" >&2
    exit 1
  fi
}

install_debian_packages() {
  local missing=() pkg
  for pkg in "${debian_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    log "Debian packages: all present"
    return
  fi
  log "Debian packages: installing ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The folder of the environment these pins make.
venv_for_pins() {
  local key
  key=$({ /usr/bin/python3 --version; cat "$requirements/main.txt" "$requirements/test.txt" "$requirements/bench.txt"; } |
        sha256sum | cut -c1-12)
  printf '%s/venv-%s' "${MESHTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshtrain}" "$key"
}

# Installs requirements/STAGE.txt unless the environment holds it already
# (a stamp per stage, written after pip succeeded).
install_stage() {
  local venv=$1 stage=$2
  if [ -f "$venv/.meshtrain-$stage" ]; then
    log "Python packages ($stage): present in $venv"
    return
  fi
  log "Python packages ($stage): installing requirements/$stage.txt into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements/$stage.txt"
  touch "$venv/.meshtrain-$stage"
}

# Removes environments of other pins but the most recently used one.
prune_old_venvs() {
  local keep=$1 cache old
  cache=$(dirname "$keep")
  local others=()
  # shellcheck disable=SC2012
  mapfile -t others < <(ls -1dt "$cache"/venv-* 2>/dev/null | grep -vxF "$keep" || true)
  for old in "${others[@]:1}"; do
    log "removing $old (pins no longer used)"
    rm -rf "$old"
  done
}

install_python_packages() {
  local venv=${MESHTRAIN_VENV:-}
  if [ -z "$venv" ]; then
    venv=$(venv_for_pins)
    mkdir -p "$(dirname "$venv")"
    # One setup at a time per machine: two clones may share the environment.
    exec 9>"$(dirname "$venv")/.lock"
    flock 9
    if [ -d "$venv" ] && [ ! -f "$venv/.meshtrain-main" ]; then
      log "removing $venv (an install that did not finish)"
      rm -rf "$venv"
    fi
  fi
  if [ ! -x "$venv/bin/python" ]; then
    log "creating the Python environment $venv"
    /usr/bin/python3 -m venv "$venv"
  fi
  local stage
  for stage in "${stages[@]}"; do install_stage "$venv" "$stage"; done
  touch "$venv"
  if [ -z "${MESHTRAIN_VENV:-}" ]; then
    prune_old_venvs "$venv"
    flock -u 9
  fi
  # .venv in the clone: the path the docs and benchmarks use.
  if [ "$(readlink -f "$root_dir/.venv" 2>/dev/null)" != "$(readlink -f "$venv")" ]; then
    if [ -e "$root_dir/.venv" ] && [ ! -L "$root_dir/.venv" ]; then
      log "replacing the folder .venv by a link to $venv"
      rm -rf "$root_dir/.venv"
    fi
    ln -sfn "$venv" "$root_dir/.venv"
  fi
}

[[ " ${stages[*]} " == *" test "* ]] && debian_packages+=("${test_debian_packages[@]}")
install_debian_packages
install_python_packages
log "done; libtorch CMake prefix: $("$root_dir/.venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
