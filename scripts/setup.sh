#!/usr/bin/env bash
# Installs everything meshtrain needs on Debian 12, idempotently:
#   - Debian packages (compiler, CMake, Open MPI, CLI11, toml++, nlohmann-json, gRPC, protobuf, OpenSSL,
#     GoogleTest, Google Benchmark, Python venv support),
#   - the pinned torch wheel (which carries libtorch) and pyarrow wheel (which carries Arrow C++, for
#     Parquet) into .venv/ of this project,
#   - the Python packages the tests use (openai, transformers, sentencepiece, lm-eval, accelerate) into the same .venv/,
#   - with --bench, the benchmarks' peers (flwr).
# Runs as root or through sudo. When everything is present it changes nothing.
set -euo pipefail

root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv_dir=${MESHTRAIN_VENV:-"$root_dir/.venv"}
torch_version=${MESHTRAIN_TORCH_VERSION:-2.11.0}
# The Arrow C++ library inside this wheel reads Parquet (the build links it).
pyarrow_version=${MESHTRAIN_PYARROW_VERSION:-26.0.1}

debian_packages=(
  g++ cmake ninja-build make pkg-config git
  libopenmpi-dev openmpi-bin iproute2
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libcpp-httplib-dev libsentencepiece-dev libpcre2-dev libutf8proc-dev liburing-dev fio
  zlib1g-dev libzstd-dev zstd
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libssl-dev openssl
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-venv python3-pip
)

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

missing_packages() {
  local pkg
  for pkg in "${debian_packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
      printf '%s\n' "$pkg"
    fi
  done
}

install_debian_packages() {
  local missing
  missing=$(missing_packages)
  if [ -z "$missing" ]; then
    log "Debian packages: all present"
    return
  fi
  # shellcheck disable=SC2086
  log "Debian packages: installing" $missing
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  # shellcheck disable=SC2086
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
}

venv_torch_version() {
  "$venv_dir/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true
}

venv_pyarrow_version() {
  "$venv_dir/bin/python" -c 'import pyarrow; print(pyarrow.__version__)' 2>/dev/null || true
}

install_torch() {
  if [ -x "$venv_dir/bin/python" ] && [ "$(venv_torch_version)" = "$torch_version" ] &&
     [ "$(venv_pyarrow_version)" = "$pyarrow_version" ]; then
    log "torch $torch_version and pyarrow $pyarrow_version: present in $venv_dir"
    return
  fi
  if [ ! -x "$venv_dir/bin/python" ]; then
    log "creating virtual environment $venv_dir"
    /usr/bin/python3 -m venv "$venv_dir"
  fi
  log "installing torch==$torch_version into $venv_dir (a few GB the first time)"
  "$venv_dir/bin/python" -m pip install --quiet --disable-pip-version-check \
    "torch==$torch_version" numpy "pyarrow==$pyarrow_version"
}

# Python packages the tests check meshtrain against, as pip-name:module: the
# official OpenAI client; Hugging Face transformers (which brings tokenizers
# and safetensors); lm-evaluation-harness with its API models, and the
# accelerate its hf backend needs; peft; grpcio-tools (a federated client
# written from federation.proto; below 1.76, whose stubs need protobuf 7,
# while flwr, for the benchmarks, needs 6) and Opacus (its privacy accountant).
test_packages=(openai:openai transformers:transformers sentencepiece:sentencepiece "lm-eval[api]:lm_eval"
               accelerate:accelerate peft:peft "grpcio-tools<1.76:grpc_tools" opacus:opacus)
install_test_packages() {
  local missing=() entry
  for entry in "${test_packages[@]}"; do
    "$venv_dir/bin/python" -c "import ${entry##*:}" 2>/dev/null || missing+=("${entry%:*}")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    log "test packages: all present"
    return
  fi
  log "installing test packages into $venv_dir:" "${missing[@]}"
  "$venv_dir/bin/python" -m pip install --quiet --disable-pip-version-check "${missing[@]}"
}

# Packages only the benchmarks' peers need (`setup.sh --bench`): Flower for
# bench/fl_vs_flower.py.
bench_packages=(flwr)
install_bench_packages() {
  if "$venv_dir/bin/python" -c "import flwr" 2>/dev/null; then
    log "benchmark packages: all present"
    return
  fi
  log "installing benchmark packages into $venv_dir:" "${bench_packages[@]}"
  "$venv_dir/bin/python" -m pip install --quiet --disable-pip-version-check "${bench_packages[@]}"
}

install_debian_packages
install_torch
install_test_packages
if [ "${1:-}" = "--bench" ]; then install_bench_packages; fi
log "done; libtorch CMake prefix: $("$venv_dir/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
