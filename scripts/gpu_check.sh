#!/usr/bin/env bash
# GPU check kit (docs/weight_sync.md, "GPU check kit"): bench/gpu_check.py on a bare CUDA PyTorch machine
# (torch, transformers; no Ray, no vLLM, no package index), run from this checkout.
#
#   bash scripts/gpu_check.sh bundle [DIR]          # here: the wheels the kit needs into DIR (gpu_check_wheels/)
#   bash scripts/gpu_check.sh run [DIR] [ARGS...]   # there: install DIR's wheels into DIR/site, run the check
#                                                   # (default ARGS: --device cuda --sizes 0.5B,1.5B,7B), 8 min limit
#
# The kit imports omegaconf (async_rl/core/config.py, under param_update/buckets.py) and antlr4 (omegaconf's)
# beyond torch and transformers; the versions carried are this checkout's venv's. verl is not carried: its
# `import verl` imports Ray (verl/protocol.py), which such a machine does not have (bench/gpu_check.py says more).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
dir=${2:-gpu_check_wheels}
LIMIT_MIB=60
case "$mode" in
  bundle)
    py=${PYTHON:-.venv/bin/python}
    pins=$("$py" -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('omegaconf', 'antlr4-python3-runtime')))")
    rm -rf "$dir" && mkdir -p "$dir"
    timeout 600 "$py" -m pip wheel --quiet --no-deps --wheel-dir "$dir" $pins
    total=0
    for w in "$dir"/*; do
      size=$(stat -c %s "$w"); total=$((total + size))
      printf '%10.2f MiB  %s\n' "$(echo "$size / 1048576" | bc -l)" "$(basename "$w")"
    done
    printf '%10.2f MiB  in all (limit %d MiB)\n' "$(echo "$total / 1048576" | bc -l)" "$LIMIT_MIB"
    if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then echo "bundle over ${LIMIT_MIB} MiB" >&2; exit 1; fi
    ;;
  run)
    py=${PYTHON:-python}
    shift; [ $# -gt 0 ] && shift
    [ $# -gt 0 ] || set -- --device cuda --sizes 0.5B,1.5B,7B
    ls "$dir"/*.whl >/dev/null || { echo "no wheels in $dir: run 'bash scripts/gpu_check.sh bundle' first" >&2; exit 1; }
    "$py" -m pip install --quiet --no-deps --no-index --target "$dir/site" "$dir"/*.whl
    export PYTHONPATH="$PWD/$dir/site${PYTHONPATH:+:$PYTHONPATH}"
    "$py" -c "import torch, transformers; print('python', __import__('sys').version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
    timeout 480 "$py" bench/gpu_check.py "$@"
    ;;
  *)
    echo "usage: bash scripts/gpu_check.sh bundle [DIR] | run [DIR] [ARGS...]" >&2; exit 2 ;;
esac
