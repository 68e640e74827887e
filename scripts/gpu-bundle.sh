#!/usr/bin/env bash
# Gathers what a GPU machine without a package registry lacks to build and run
# meshtrain: the Debian packages of Open MPI, CLI11, toml++, nlohmann-json,
# liburing, cpp-httplib, SentencePiece, PCRE2, utf8proc, gRPC, protobuf, OpenSSL,
# GoogleTest and Google Benchmark with the runtime libraries they load, fetched
# with `apt-get download` and unpacked into one folder (git-ignored). Carry that
# folder to the machine; scripts/gpu-check.sh finds it there.
#
#   bash scripts/gpu-bundle.sh [FOLDER]     (default: .gpu-bundle)
#
# The folder holds root/ (the packages unpacked as if into /), env.sh (sourced
# by gpu-check.sh: PATH, LD_LIBRARY_PATH, OPAL_PREFIX, CMake hints) and
# packages.txt (name and version of each package). The same folder packed as
# FOLDER.tar.gz (a third of the size) is what travels where a carried path is
# limited in size; gpu-check.sh unpacks it when the folder is absent.
set -euo pipefail
root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bundle=${1:-"$root_dir/.gpu-bundle"}
debs=${MESHTRAIN_BUNDLE_DEBS:-"$root_dir/build-gpu-debs"}  # downloads, kept apart: only the bundle travels

# Build-time packages, then the shared libraries Open MPI, its plugins and
# PMIx load (found with ldd on this machine's install; the C and C++ runtime
# and zlib are on every machine and stay out).
packages=(
  libopenmpi-dev libopenmpi3 openmpi-bin openmpi-common libpmix2 libpmix-dev
  libcli11-dev libtomlplusplus-dev libtomlplusplus3 nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian
  liburing-dev liburing2 libcpp-httplib-dev libcpp-httplib0.11 libbrotli1 libsentencepiece-dev libsentencepiece0
  libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2 libbrotli-dev zlib1g-dev pkgconf pkgconf-bin libpkgconf3
  libgrpc++-dev libgrpc++1.51 libgrpc-dev libgrpc29 libabsl-dev libabsl20220623 libc-ares-dev libc-ares2
  libre2-dev libre2-9 libprotobuf-dev libprotobuf32 libprotobuf-lite32 libprotoc32 protobuf-compiler
  protobuf-compiler-grpc libssl-dev libssl3
  libhwloc15 libhwloc-dev libevent-core-2.1-7 libevent-pthreads-2.1-7 libevent-2.1-7 libevent-extra-2.1-7
  libevent-openssl-2.1-7 libevent-dev libfabric1 libibverbs1 ibverbs-providers librdmacm1 libmunge2
  libnl-3-200 libnl-route-3-200 libnuma1 libpsm-infinipath1 libpsm2-2 libucx0 libatomic1 libltdl7
)

log() { printf 'gpu-bundle: %s\n' "$*"; }

mkdir -p "$debs"
rm -rf "$bundle/root"
mkdir -p "$bundle/root"
(
  cd "$debs"
  missing=()
  for p in "${packages[@]}"; do
    ls "${p}"_*.deb >/dev/null 2>&1 || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "downloading ${#missing[@]} package(s)"
    apt-get download "${missing[@]}" >/dev/null 2>&1 || {
      apt-get update -qq >/dev/null 2>&1 || true
      apt-get download "${missing[@]}"
    }
  fi
)
: > "$bundle/packages.txt"
for p in "${packages[@]}"; do
  deb=$(ls "$debs/${p}"_*.deb | tail -1)
  dpkg-deb -x "$deb" "$bundle/root"
  dpkg-deb -f "$deb" Package Version | paste -sd' ' >> "$bundle/packages.txt"
done
# Documentation, manuals and translations are not needed to build or run.
rm -rf "$bundle/root/usr/share/doc" "$bundle/root/usr/share/man" "$bundle/root/usr/share/locale" \
       "$bundle/root/usr/share/lintian" "$bundle/root/usr/lib/x86_64-linux-gnu/fortran"
# Static archives too, except the test and benchmark libraries and the protobuf
# meshtrain links statically (Note [Two protobufs]).
find "$bundle/root" -name '*.a' ! -name 'libgtest*' ! -name 'libgmock*' ! -name 'libbenchmark*' \
  ! -name 'libprotobuf.a' -delete

# Debian names the Open MPI programs *.openmpi and links the plain names through
# update-alternatives, which unpacking does not run: make the plain names here.
for tool in mpirun mpiexec mpicc mpicxx mpic++ ompi_info orterun; do
  for target in "$bundle/root/usr/bin/$tool.openmpi" "$bundle/root/usr/bin/orterun"; do
    if [ -e "$target" ] && [ ! -e "$bundle/root/usr/bin/$tool" ]; then
      ln -s "$(basename "$target")" "$bundle/root/usr/bin/$tool"
      break
    fi
  done
done

cat > "$bundle/env.sh" <<'EOF'
# Sourced to use the unpacked packages in place of installed ones.
bundle_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/root" && pwd)
multiarch=$bundle_root/usr/lib/x86_64-linux-gnu
export PATH="$bundle_root/usr/bin:$PATH"
export LD_LIBRARY_PATH="$multiarch/openmpi/lib:$multiarch/pmix2/lib:$multiarch:$multiarch/libfabric:${LD_LIBRARY_PATH:-}"
# Open MPI and PMIx find their plugins and help texts relative to these.
export OPAL_PREFIX="$bundle_root/usr"
export PMIX_PREFIX="$multiarch/pmix2"
export PMIX_MCA_mca_base_component_path="$multiarch/pmix2/lib/pmix"
export OMPI_MCA_mca_base_component_show_load_errors=0
export PMIX_MCA_pcompress_base_silence_warning=1
export CMAKE_PREFIX_PATH="$bundle_root/usr:${CMAKE_PREFIX_PATH:-}"
# pkg-config (cpp-httplib) and its .pc files.
export PKG_CONFIG_PATH="$multiarch/pkgconfig:$bundle_root/usr/share/pkgconfig:${PKG_CONFIG_PATH:-}"
# FindMPI: the unpacked wrapper compiler and mpiexec.
export MESHTRAIN_BUNDLE_CMAKE_ARGS="-DMPI_CXX_COMPILER=$bundle_root/usr/bin/mpicxx -DMPIEXEC_EXECUTABLE=$bundle_root/usr/bin/mpirun"
EOF
tar -C "$(dirname "$bundle")" -czf "$bundle.tar.gz" "$(basename "$bundle")"
log "$(wc -l < "$bundle/packages.txt") packages unpacked into $bundle/root ($(du -sh "$bundle/root" | cut -f1)); source $bundle/env.sh to use them; packed as $bundle.tar.gz ($(du -sh "$bundle.tar.gz" | cut -f1))"
