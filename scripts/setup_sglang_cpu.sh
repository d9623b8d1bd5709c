#!/usr/bin/env bash
# .venv-sglang: SGLang 0.5.12 on CPU with its CPU kernels built from SGLang's source, torch 2.11.0,
# verl 0.9.1 and this package (docs/sglang_cpu.md). Run as `bash scripts/setup.sh --sglang-cpu`.
#
#   SGLANG_SRC    a checkout of github.com/sgl-project/sglang at SGLANG_COMMIT (default .sglang-src;
#                 cloned there when missing, which needs GitHub)
#   SGLANG_BUILD  where the kernels are built and their wheel kept (default .sglang-build): a rerun
#                 installs that wheel without compiling
#   BUILD_JOBS    parallel compile jobs (default 2)
#
# Needs g++ (12 works), libnuma-dev and a CPU with AVX-512 (the kernels are compiled with -march=native,
# so the wheel runs only on CPUs like the one that built it). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
VENV=.venv-sglang
PY="${PYTHON:-python3}"
SGLANG_VERSION=0.5.12
# the main-branch commit whose python/sglang matches the sglang 0.5.12 wheel (the release branch adds
# a few fixes) and whose sgl-kernel is 0.4.2.post2, the kernel version that wheel pins
SGLANG_COMMIT=21b3ac52b460650799bcd93199fa576561ab6998
KERNEL_VERSION=0.4.2.post2
SGLANG_SRC="${SGLANG_SRC:-.sglang-src}"
SGLANG_BUILD="${SGLANG_BUILD:-.sglang-build}"
BUILD_JOBS="${BUILD_JOBS:-2}"
# verl 0.9.1's `sglang` extra: torch 2.11.0 (on this registry a CUDA build; it runs on CPU), its
# torchvision / torchaudio (SGLang imports torchvision), transformers 5.9.0
TORCH_PINS=(torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0)
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
printf '%s\n' "${TORCH_PINS[@]}" transformers==5.9.0 > "$CONSTRAINTS"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q "${TORCH_PINS[@]}"
# SGLang's Python package: the release wheel without its dependencies (they name the CUDA kernels),
# then the CPU project file's dependency list
"${PIP[@]}" install -q --no-deps "sglang==${SGLANG_VERSION}"
"${PIP[@]}" install -q -c "$CONSTRAINTS" -r scripts/sglang_cpu_requirements.txt

kernel_installed() {
  "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang-kernel-cpu') != '$KERNEL_VERSION')" 2>/dev/null
}

if ! kernel_installed; then
  mkdir -p "$SGLANG_BUILD"
  wheel="$(ls "$SGLANG_BUILD"/dist/sglang_kernel_cpu-"$KERNEL_VERSION"-*.whl 2>/dev/null | head -1 || true)"
  if [ -z "$wheel" ]; then
    if [ ! -f "$SGLANG_SRC/sgl-kernel/pyproject_cpu.toml" ]; then
      echo "[setup] SGLang's source: fetching commit $SGLANG_COMMIT into $SGLANG_SRC"
      if ! { git init -q "$SGLANG_SRC" \
             && git -C "$SGLANG_SRC" fetch -q --depth 1 https://github.com/sgl-project/sglang "$SGLANG_COMMIT" \
             && git -C "$SGLANG_SRC" checkout -q FETCH_HEAD; }; then
        echo "error: SGLang's CPU kernels are built from SGLang's source, which no package registry holds." >&2
        echo "  Set SGLANG_SRC to a checkout of https://github.com/sgl-project/sglang at $SGLANG_COMMIT" >&2
        echo "  (git fetch of that commit failed: is GitHub reachable?). docs/sglang_cpu.md" >&2
        exit 1
      fi
    fi
    found="$(sed -n 's/^version = "\(.*\)"/\1/p' "$SGLANG_SRC/sgl-kernel/pyproject_cpu.toml")"
    if [ "$found" != "$KERNEL_VERSION" ]; then
      echo "error: $SGLANG_SRC/sgl-kernel is version '$found', not $KERNEL_VERSION: check out $SGLANG_COMMIT" >&2
      exit 1
    fi
    if ! ls /usr/lib/*-linux-gnu/libnuma.so /usr/lib64/libnuma.so >/dev/null 2>&1; then
      echo "error: the kernels link libnuma: apt-get install libnuma-dev" >&2
      exit 1
    fi
    # SGLang's CPU build (docs: "CPU Servers"): sgl-kernel/ with pyproject_cpu.toml as its project file;
    # built on a copy, so the checkout is left as it is. torch is the installed one (no build isolation).
    "${PIP[@]}" install -q scikit-build-core cmake ninja wheel
    mkdir -p "$SGLANG_BUILD/sgl-kernel"
    cp -a "$SGLANG_SRC/sgl-kernel/." "$SGLANG_BUILD/sgl-kernel/"
    cp "$SGLANG_BUILD/sgl-kernel/pyproject_cpu.toml" "$SGLANG_BUILD/sgl-kernel/pyproject.toml"
    build_start=$SECONDS
    echo "[setup] compiling SGLang's CPU kernels ($BUILD_JOBS jobs; one to a few hours on 2 cores)"
    CMAKE_BUILD_PARALLEL_LEVEL="$BUILD_JOBS" "${PIP[@]}" wheel -q --no-build-isolation --no-deps \
      -w "$SGLANG_BUILD/dist" \
      --config-settings=build-dir="$PWD/$SGLANG_BUILD/cmake" \
      --config-settings=cmake.define.CMAKE_PROJECT_INCLUDE="$PWD/scripts/sglang_cpu_torch_cuda.cmake" \
      "$SGLANG_BUILD/sgl-kernel"
    echo "[setup] SGLang's CPU kernels compiled in $(( (SECONDS - build_start) / 60 )) min"
    wheel="$(ls "$SGLANG_BUILD"/dist/sglang_kernel_cpu-"$KERNEL_VERSION"-*.whl | head -1)"
  fi
  "${PIP[@]}" install -q --no-deps --force-reinstall "$wheel"
fi

"${PIP[@]}" install -q -c "$CONSTRAINTS" -e ".[test]"
"$VENV/bin/python" -m compileall -q async_rl state_machines param_update verl_patches examples bench tests >/dev/null
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c \
  "import sgl_kernel, sglang.srt.entrypoints.http_server, verl.workers.rollout.sglang_rollout.async_sglang_server"
echo "[setup] $VENV ready in $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
