#!/usr/bin/env bash
# Builds and checks meshtrain on a machine with a GPU, in minutes: configures
# against that machine's own torch (python3, or MESHTRAIN_PYTHON), builds with
# every core, runs the CUDA tests, a short training run on the GPU and the GPU
# benchmarks, and writes logs and tables into OUT_DIR. Needs the folder
# scripts/gpu-bundle.sh made (Open MPI, CLI11, toml++, ... unpacked) unless the
# machine has those packages installed (the folder, or FOLDER.tar.gz beside it, unpacked when newer).
#
#   bash scripts/gpu-check.sh OUT_DIR [STAGES]
#
# STAGES: a comma-separated subset of facts,build,test,train,bench,profile
# (default: all of them; profile: gpt2-124m's kernels beside PyTorch's). Each stage runs even when an earlier one failed (a failed build
# ends the run); the exit status is non-zero when any failed. Environment:
#   MESHTRAIN_BUNDLE  the bundle folder (default: .gpu-bundle)
#   BUILD_DIR         (default: build-gpu)
#   BENCH_PRESETS     models of the benchmark, PRESET[:BATCHxCONTEXT] (default:
#                     gpt2-124m gpt2-350m llama3.2-1b:8x2048)
set -uo pipefail
root_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: gpu-check.sh OUT_DIR [facts,build,test,train,bench,profile]}
stages=",${2:-facts,build,test,train,bench,profile},"
bundle=${MESHTRAIN_BUNDLE:-"$root_dir/.gpu-bundle"}
build_dir=${BUILD_DIR:-"$root_dir/build-gpu"}
python=${MESHTRAIN_PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_hwloc_base_binding_policy=none
bundle_cmake_args=()
if [ -f "$bundle.tar.gz" ] && [ "$bundle.tar.gz" -nt "$bundle/packages.txt" ]; then
  rm -rf "$bundle" && tar -C "$(dirname "$bundle")" -xzf "$bundle.tar.gz"
fi
if [ -f "$bundle/env.sh" ]; then
  # shellcheck disable=SC1091
  source "$bundle/env.sh"
  read -r -a bundle_cmake_args <<< "$MESHTRAIN_BUNDLE_CMAKE_ARGS"
fi

failed=()
stage() { [[ $stages == *",$1,"* ]]; }
say() { printf 'gpu-check: %s\n' "$*"; }
elapsed() { printf '%ds' $((SECONDS - $1)); }

if stage facts; then
  {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    "$python" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
    echo "cores $(nproc)"; g++ --version | head -1; cmake --version | head -1; ninja --version
    command -v mpirun && mpirun --version | head -1
  } > "$out/facts.txt" 2>&1
  cat "$out/facts.txt"
fi

if stage build; then
  start=$SECONDS
  torch_prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  {
    if [ ! -f "$build_dir/build.ninja" ]; then
      cmake -S "$root_dir" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_PREFIX_PATH="$torch_prefix" "${bundle_cmake_args[@]}" -DMESHTRAIN_BUILD_BENCHMARKS=OFF
    fi
    cmake --build "$build_dir" --parallel "$(nproc)" --target meshtrain_app meshtrain_cuda_tests
  } > "$out/build.log" 2>&1
  status=$?
  grep -E '^-- meshtrain:' "$out/build.log" || true
  if [ $status -ne 0 ]; then
    tail -40 "$out/build.log"
    say "build failed after $(elapsed $start); see build.log"
    exit 1
  fi
  say "built in $(elapsed $start)"
fi

if stage test; then
  start=$SECONDS
  (cd "$build_dir" && ctest -L cuda -V --timeout 600) > "$out/tests.log" 2>&1 || failed+=(test)
  grep -E 'tests passed|Passed|Failed|Skipped|\*\*\*|measured|FAILED' "$out/tests.log" | tail -30
  say "CUDA tests in $(elapsed $start)"
fi

if stage train; then
  start=$SECONDS
  # The small preset on the GPU, bfloat16 autocast: the main job's model, 200 steps.
  "$build_dir/bin/meshtrain" train --run.device=cuda --training.dtype=bfloat16 --model.preset=small \
    --training.steps=200 --training.batch=64 --training.micro_batch=64 --data.text="$root_dir/docs" \
    --run.out="$out/train-run" --checkpoint.every=100 --training.sample_tokens=200 \
    > "$out/train.log" 2>&1 || failed+=(train)
  tail -12 "$out/train.log"
  cp "$out/train-run/metrics.jsonl" "$out/train-metrics.jsonl" 2>/dev/null || true
  rm -rf "$out/train-run"
  say "training run in $(elapsed $start)"
fi

if stage bench; then
  start=$SECONDS
  # shellcheck disable=SC2086
  "$python" "$root_dir/bench/gpu_train_vs_pytorch.py" --meshtrain "$build_dir/bin/meshtrain" \
    --presets ${BENCH_PRESETS-gpt2-124m gpt2-350m llama3.2-1b:8x2048} --markdown "$out/bench.md" > "$out/bench.log" 2>&1 || failed+=(bench)
  tail -12 "$out/bench.log"
  # What the fused CUDA kernels give (Note [Fused CUDA kernels]): GPT-2 124M with them off, beside eager again.
  MESHTRAIN_CUDA_KERNELS=off "$python" "$root_dir/bench/gpu_train_vs_pytorch.py" --meshtrain "$build_dir/bin/meshtrain" \
    --presets gpt2-124m --no-compile --largest '' --graph --markdown "$out/bench-kernels-off.md" \
    > "$out/bench-kernels-off.log" 2>&1 || failed+=(bench-kernels-off)
  tail -4 "$out/bench-kernels-off.log"
  say "benchmarks in $(elapsed $start)"
fi

if stage profile; then
  start=$SECONDS
  # Where a step's GPU time goes: each side's kernels by time on the device (docs/gpus.md).
  "$python" "$root_dir/bench/profile_vs_pytorch.py" --device cuda --preset gpt2-124m --batch 16 --micro-batch 16 \
    --meshtrain "$build_dir/bin/meshtrain" --out "$out/profile-run" --top 15 > "$out/profile.txt" 2>&1 || failed+=(profile)
  rm -rf "$out/profile-run"
  tail -40 "$out/profile.txt"
  say "profile in $(elapsed $start)"
fi

if [ ${#failed[@]} -gt 0 ]; then
  say "failed: ${failed[*]} (logs in $out)"
  exit 1
fi
say "done (logs in $out)"
