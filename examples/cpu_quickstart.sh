#!/usr/bin/env bash
# Set up, build the tiny demo (model, tokenizer, data, reward) and train it with the
# async pipeline through a plain verl command; its timeline and report go to $DEMO_DIR/trace.
# Extra arguments are passed to verl.
# OVERRIDES picks the task: overrides.txt (copy digits, GRPO), overrides_ppo.txt (PPO with a
# critic), overrides_agent.txt (an agent loop calling a lookup tool).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
DEMO_DIR="${DEMO_DIR:-demo_run}"
.venv/bin/python -m async_rl.demo prepare --output-dir "$DEMO_DIR"
export VERL_FILE_LOGGER_PATH="${VERL_FILE_LOGGER_PATH:-$DEMO_DIR/metrics.jsonl}"
# shellcheck disable=SC2046
.venv/bin/python -m verl.trainer.main_ppo $(cat "$DEMO_DIR/${OVERRIDES:-overrides.txt}") \
    "+trainer.async_trace_path=$DEMO_DIR/trace" "$@"  # the run's timeline and report.html
