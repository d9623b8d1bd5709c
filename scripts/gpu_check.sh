#!/usr/bin/env bash
# GPU check kit (docs/weight_sync.md, "GPU check kit"), run from this checkout on a CUDA PyTorch machine with no
# package index (Python 3.12, torch, transformers, numpy, pandas, pyarrow, peft; no Ray, no verl, no vLLM):
# bench/gpu_worker_step.py (verl's FSDP2 engine training through the pipeline's worker), then bench/gpu_check.py
# (the sync's GPU parts between two processes).
#
#   bash scripts/gpu_check.sh bundle [DIR]          # here: Python 3.12 wheels of scripts/gpu_check_requirements.txt
#                                                   # at this checkout's .venv's versions, cut into parts DIR/1, DIR/2,
#                                                   # ... (default DIR: gpu_check_bundle/)
#   bash scripts/gpu_check.sh receive [DIR]         # there: which parts have arrived
#   bash scripts/gpu_check.sh run [DIR] [ARGS...]   # there: the parts put together and installed into DIR/site, then
#                                                   # the worker step (sizes: WORKER_SIZES, default 0.5B,1.5B) and
#                                                   # gpu_check.py ARGS (default --device cuda --sizes 0.5B,1.5B,7B);
#                                                   # 8 min limit for both (KIT_DEVICE=cpu: both on the CPU)
#
# A device call carries 64 MiB with the checkout, and Ray's wheel alone is 76 MiB: each call carries one part, all on
# one warm machine (what a call leaves in an ignored folder stays there until the machine goes back), and the call
# with the last part runs the kit. `run` names any part missing, and `bundle` prints the calls.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
dir=${2:-gpu_check_bundle}
PART_MIB=56  # + the checkout (about 5 MiB) under the 64 MiB a device call carries
LIMIT_S=480
case "$mode" in
  bundle)
    py=${PYTHON:-.venv/bin/python}
    mapfile -t names < <(grep -v '^#' scripts/gpu_check_requirements.txt)
    pinned="import importlib.metadata as m, sys; [print(f'{n}=={m.version(n)}') for n in sys.argv[1:]]"
    mapfile -t pins < <("$py" -c "$pinned" "${names[@]}")
    rm -rf "$dir" && mkdir -p "$dir/wheels"
    for pin in "${pins[@]}"; do  # the Python 3.12 wheel; a package published only as source is pure Python: built here
      timeout 300 "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir/wheels" "$pin" \
        2>/dev/null \
      || timeout 300 "$py" -m pip wheel --quiet --no-deps --wheel-dir "$dir/wheels" "$pin"
    done
    for w in "$dir"/wheels/*.whl; do
      case "$w" in *-cp312-*|*-abi3-*|*-none-any.whl) ;;
        *) echo "not a Python 3.12 wheel: $w" >&2; exit 1 ;; esac
    done
    wheel_bytes=$(du -cb "$dir"/wheels/*.whl | tail -1 | cut -f1)
    printf '%s wheels, %.2f MiB\n' "$(ls "$dir"/wheels/*.whl | wc -l)" "$(awk "BEGIN {print $wheel_bytes / 1048576}")"
    python3 scripts/gpu_bundle.py split "$dir/wheels" "$dir" --part-mib "$PART_MIB"
    rm -rf "$dir/wheels"
    # what a call carries besides its part: the checkout's files that git does not ignore
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
      | awk '{s += $1} END {print s + 0}')
    for part in "$dir"/[0-9]*/part; do
      total=$(( $(stat -c %s "$part") + tree ))
      if [ "$total" -gt $((64 * 1048576)) ]; then
        echo "a call carrying $part and the checkout ($tree bytes) would carry $total bytes, over 64 MiB" >&2; exit 1
      fi
    done
    count=$(ls -d "$dir"/[0-9]* | wc -l)
    echo "device calls, one after the other on one warm machine:"
    for ((k = 1; k < count; k++)); do echo "  carry [$dir/$k]  command: bash scripts/gpu_check.sh receive $dir"; done
    echo "  carry [$dir/$count]  command: bash scripts/gpu_check.sh run $dir"
    ;;
  receive)
    python3 scripts/gpu_bundle.py status "$dir" || true
    ;;
  run)
    py=${PYTHON:-python3}
    device=${KIT_DEVICE:-cuda}
    shift; [ $# -gt 0 ] && shift
    [ $# -gt 0 ] || set -- --device "$device" --sizes 0.5B,1.5B,7B
    start=$SECONDS
    rm -rf "$dir/wheels" "$dir/site"
    "$py" scripts/gpu_bundle.py join "$dir" "$dir/wheels"
    "$py" -m pip install --quiet --no-deps --no-index --no-compile --target "$dir/site" "$dir"/wheels/*.whl
    PYTHONPATH="$(cd "$dir/site" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONPATH
    "$py" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
      'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
    echo "installed in $((SECONDS - start)) s"
    rc=0
    within() {  # "$@" in what is left of the kit's LIMIT_S
      local left=$((LIMIT_S - (SECONDS - start)))
      if [ "$left" -le 0 ]; then echo "the kit's ${LIMIT_S} s are spent: $* not run" >&2; return 124; fi
      timeout "$left" "$@"
    }
    within "$py" bench/gpu_worker_step.py --device "$device" --sizes "${WORKER_SIZES:-0.5B,1.5B}" || rc=$?
    within "$py" bench/gpu_check.py "$@" || rc=$?
    exit $rc
    ;;
  *)
    echo "usage: bash scripts/gpu_check.sh bundle [DIR] | receive [DIR] | run [DIR] [ARGS...]" >&2; exit 2 ;;
esac
