# Finds what meshtrain builds against and defines:
#   Threads::Threads, MPI::MPI_CXX, TORCH_LIBRARIES (libtorch targets),
#   CLI11::CLI11, tomlplusplus::tomlplusplus, nlohmann_json::nlohmann_json, PkgConfig::HTTPLIB,
#   MESHTRAIN_GRPC_LIBRARIES, MESHTRAIN_PROTOC, MESHTRAIN_GRPC_CPP_PLUGIN, OpenSSL::Crypto/SSL,
#   MESHTRAIN_SENTENCEPIECE_LIBRARIES, MESHTRAIN_PCRE2_LIBRARY, MESHTRAIN_UTF8PROC_LIBRARY, MESHTRAIN_URING_LIBRARY,
#   MESHTRAIN_HAVE_CUDA (libtorch has CUDA and MESHTRAIN_CUDA is not OFF), MESHTRAIN_TORCH_INCLUDE_DIRS (set when
#   CUDA is off: libtorch's headers, which the CPU-only targets do not carry), MESHTRAIN_HAVE_NCCL and, when true, MESHTRAIN_NCCL_INCLUDE_DIR / MESHTRAIN_NCCL_LIBRARY.

find_package(Threads REQUIRED)
find_package(MPI REQUIRED COMPONENTS CXX)

# libtorch probes the GPU to pick CUDA architectures when it has CUDA; name the
# H100's and H200's and skip the probe. The fused CUDA kernels (CMakeLists.txt)
# are built for this list, each with its PTX for later GPUs; set
# TORCH_CUDA_ARCH_LIST ("8.0 9.0") for others.
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT TORCH_CUDA_ARCH_LIST)
  set(TORCH_CUDA_ARCH_LIST "9.0")
endif()
find_package(Torch REQUIRED)
if(Torch_VERSION AND Torch_VERSION VERSION_LESS 2.4)
  message(FATAL_ERROR "meshtrain needs libtorch >= 2.4; found ${Torch_VERSION} at ${Torch_DIR}")
endif()

find_package(CLI11 CONFIG REQUIRED)
find_package(tomlplusplus CONFIG REQUIRED)
find_package(nlohmann_json 3 CONFIG REQUIRED)
# cpp-httplib (Debian's libcpp-httplib-dev), for meshtrain serve.
find_package(PkgConfig REQUIRED)
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
# Tokenizers: SentencePiece (libsentencepiece-dev), PCRE2 (the patterns
# tokenizer.json files carry) and utf8proc (Unicode normalization and
# classes), linked by file so the installed package needs no targets of theirs.
find_library(MESHTRAIN_SENTENCEPIECE_LIBRARY sentencepiece REQUIRED)
find_library(MESHTRAIN_SENTENCEPIECE_TRAIN_LIBRARY sentencepiece_train REQUIRED)
set(MESHTRAIN_SENTENCEPIECE_LIBRARIES ${MESHTRAIN_SENTENCEPIECE_TRAIN_LIBRARY} ${MESHTRAIN_SENTENCEPIECE_LIBRARY})
find_library(MESHTRAIN_PCRE2_LIBRARY pcre2-8 REQUIRED)
find_library(MESHTRAIN_UTF8PROC_LIBRARY utf8proc REQUIRED)
# Federated learning: gRPC and protobuf (libgrpc++-dev, protobuf-compiler-grpc),
# OpenSSL (X25519, AES-GCM, TLS). Libraries by pkg-config, the code generators by path.
# protobuf is linked statically with its symbols hidden (Note [Two protobufs]).
#
# Note [Two protobufs]
# Debian's libsentencepiece carries its own protobuf-lite and exports its
# symbols; with the system's libprotobuf.so in the same process the two
# interpose each other (libprotobuf's start-up code ran sentencepiece's copy
# of a parser and crashed). So protobuf comes from libprotobuf.a, first on the
# link line (our references bind to it, not to sentencepiece), its symbols
# made local (--exclude-libs) and none of ours exported to shared libraries
# (fl/protobuf_local.map), so sentencepiece keeps binding to its own copy.
pkg_check_modules(MESHTRAIN_GRPC REQUIRED grpc++)
pkg_check_modules(MESHTRAIN_PROTOBUF_PC REQUIRED protobuf)
set(MESHTRAIN_GRPC_LIBRARIES ${MESHTRAIN_GRPC_LINK_LIBRARIES})
find_library(MESHTRAIN_PROTOBUF_STATIC NAMES libprotobuf.a REQUIRED)
find_program(MESHTRAIN_PROTOC protoc REQUIRED)
find_program(MESHTRAIN_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)
find_package(OpenSSL REQUIRED)
# libtorch's include directory carries an old copy of protobuf's headers
# (torch/include/google/protobuf) that shadows the system's; a directory of
# the build tree holding only a link to the system's google/ goes first.
pkg_get_variable(MESHTRAIN_PROTOBUF_INCLUDEDIR protobuf includedir)
set(MESHTRAIN_PROTOBUF_INCLUDE ${CMAKE_BINARY_DIR}/protobuf-include)
file(MAKE_DIRECTORY ${MESHTRAIN_PROTOBUF_INCLUDE})
if(NOT EXISTS ${MESHTRAIN_PROTOBUF_INCLUDE}/google)
  file(CREATE_LINK ${MESHTRAIN_PROTOBUF_INCLUDEDIR}/google ${MESHTRAIN_PROTOBUF_INCLUDE}/google SYMBOLIC)
endif()
# The NVMe tier: io_uring (liburing-dev).
find_library(MESHTRAIN_URING_LIBRARY uring REQUIRED)
# Data sources: gzip (zlib1g-dev) and zstd (libzstd-dev) JSON Lines, and Parquet
# read with Apache Arrow's C++ library from the pyarrow wheel beside torch
# (Debian 12 packages no Arrow), linked by file with its own soname.
find_library(MESHTRAIN_ZLIB_LIBRARY z REQUIRED)
find_library(MESHTRAIN_ZSTD_LIBRARY zstd REQUIRED)
get_filename_component(_meshtrain_site_packages "${Torch_DIR}/../../../.." ABSOLUTE)
set(MESHTRAIN_ARROW_DIR "${_meshtrain_site_packages}/pyarrow" CACHE PATH "pyarrow's package folder (Arrow C++ headers and libraries)")
file(GLOB MESHTRAIN_ARROW_LIBRARY "${MESHTRAIN_ARROW_DIR}/libarrow.so.[0-9]*")
file(GLOB MESHTRAIN_PARQUET_LIBRARY "${MESHTRAIN_ARROW_DIR}/libparquet.so.[0-9]*")
if(NOT MESHTRAIN_ARROW_LIBRARY OR NOT MESHTRAIN_PARQUET_LIBRARY OR NOT EXISTS "${MESHTRAIN_ARROW_DIR}/include/parquet")
  message(FATAL_ERROR "meshtrain reads Parquet with the Arrow C++ library in the pyarrow wheel, not found in "
                      "${MESHTRAIN_ARROW_DIR}; run scripts/setup.sh (it installs pyarrow into .venv)")
endif()
list(GET MESHTRAIN_ARROW_LIBRARY 0 MESHTRAIN_ARROW_LIBRARY)
list(GET MESHTRAIN_PARQUET_LIBRARY 0 MESHTRAIN_PARQUET_LIBRARY)
message(STATUS "meshtrain: Parquet via ${MESHTRAIN_PARQUET_LIBRARY}")

# NCCL: only meaningful when libtorch itself was built with CUDA. Prefer the NCCL
# that ships beside the torch wheel (the one libtorch_cuda loads), then the CUDA
# toolkit's, then the system's.
set(MESHTRAIN_HAVE_NCCL OFF)
set(_meshtrain_torch_has_cuda OFF)
if(TARGET torch_cuda OR TARGET c10_cuda OR "${TORCH_LIBRARIES}" MATCHES "c10_cuda")
  set(_meshtrain_torch_has_cuda ON)
endif()
# Note [A build for the CPU only]
# A libtorch with CUDA loads libtorch_cuda and the CUDA libraries into every
# process, whether or not a GPU is there: 0.13 s of 0.35 s at each start of the
# meshtrain executable on a 2-core machine (a test suite starts it ~900 times).
# MESHTRAIN_CUDA=OFF links libtorch_cpu only, for the build tree; the installed
# package still hands consumers the whole libtorch. scripts/build.sh picks OFF
# where no NVIDIA driver is loaded; the GPU build (scripts/gpu-check.sh) and a
# plain configure keep AUTO: CUDA whenever libtorch has it.
set(MESHTRAIN_CUDA "AUTO" CACHE STRING
    "Link libtorch's CUDA libraries: AUTO (when libtorch has CUDA), ON, or OFF (CPU only, faster process start)")
set_property(CACHE MESHTRAIN_CUDA PROPERTY STRINGS AUTO ON OFF)
if(MESHTRAIN_CUDA STREQUAL "ON" AND NOT _meshtrain_torch_has_cuda)
  message(FATAL_ERROR "MESHTRAIN_CUDA=ON but the libtorch at ${Torch_DIR} was built without CUDA")
endif()
if(_meshtrain_torch_has_cuda AND MESHTRAIN_CUDA STREQUAL "OFF")
  set(_meshtrain_torch_has_cuda OFF)
  set(MESHTRAIN_TORCH_INCLUDE_DIRS ${TORCH_INCLUDE_DIRS})
  set(TORCH_LIBRARIES $<BUILD_INTERFACE:torch_cpu_library> $<BUILD_INTERFACE:c10>
      $<INSTALL_INTERFACE:torch> $<INSTALL_INTERFACE:torch_library>)
  message(STATUS "meshtrain: CUDA OFF, libtorch_cpu only (MESHTRAIN_CUDA=OFF)")
endif()
set(MESHTRAIN_HAVE_CUDA ${_meshtrain_torch_has_cuda})
if(NOT MESHTRAIN_WITH_NCCL STREQUAL "OFF")
  if(MESHTRAIN_HAVE_CUDA)
    get_filename_component(_meshtrain_site "${Torch_DIR}/../../../.." ABSOLUTE)
    set(_meshtrain_nccl_hints ${MESHTRAIN_NCCL_ROOT} $ENV{NCCL_ROOT}
        "${_meshtrain_site}/nvidia/nccl" ${CUDAToolkit_LIBRARY_ROOT} /usr/local/cuda)
    find_path(MESHTRAIN_NCCL_INCLUDE_DIR nccl.h HINTS ${_meshtrain_nccl_hints}
              PATH_SUFFIXES include)
    find_library(MESHTRAIN_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_meshtrain_nccl_hints}
                 PATH_SUFFIXES lib lib64)
    if(MESHTRAIN_NCCL_INCLUDE_DIR AND MESHTRAIN_NCCL_LIBRARY)
      set(MESHTRAIN_HAVE_NCCL ON)
      message(STATUS "meshtrain: NCCL backend ON (${MESHTRAIN_NCCL_LIBRARY})")
    endif()
  endif()
  if(NOT MESHTRAIN_HAVE_NCCL)
    if(MESHTRAIN_WITH_NCCL STREQUAL "ON")
      message(FATAL_ERROR "MESHTRAIN_WITH_NCCL=ON but the build has no CUDA (MESHTRAIN_CUDA=OFF or libtorch without it) or nccl.h was not found "
                          "(set MESHTRAIN_NCCL_ROOT to the NCCL install)")
    endif()
    message(STATUS "meshtrain: NCCL backend OFF (libtorch without CUDA or no NCCL found)")
  endif()
endif()
if(MESHTRAIN_WITH_NCCL STREQUAL "OFF")
  message(STATUS "meshtrain: NCCL backend OFF (MESHTRAIN_WITH_NCCL=OFF)")
endif()
