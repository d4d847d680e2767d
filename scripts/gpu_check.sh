#!/usr/bin/env bash
# On a machine with a CUDA GPU: every notebook's cells, the `#| cuda` ones included (`nbdev_test --flags cuda`), then
# the GPU benchmark (`nanoserve bench gpu`, chapter 15); one table at the end. Budget: a few minutes on one H200.
#
# The lent GPU machine has torch, triton and transformers but reaches no package registry: bring the other wheels
# in ./.whl (`bash scripts/gpu_wheels.sh` on a machine that reaches PyPI; carry `.whl`).
# REHEARSE=1 runs the same steps on a CPU, without CUDA, on one small chapter and without the GPU benchmark, so that
# CI keeps this script working between the rare runs on a GPU (tests/test_gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/nanoserve-gpu-check}"; mkdir -p "$OUT"
REHEARSE="${REHEARSE:-0}"

if ! python3 -c 'import nbdev, hypothesis, fastapi, zmq' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  echo "== installing the carried wheels"
  python3 -m pip install -q --no-index --no-deps --find-links .whl .whl/*.whl 2>&1 | tail -3
fi
if [ "$REHEARSE" = 1 ]; then
  paths=(--path nbs/00_config.ipynb); flags=(); echo "== rehearsal on a CPU: nbdev_test on one chapter, no GPU benchmark"
else
  python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())' || exit 1
  paths=(); flags=(--flags cuda)
fi

echo "== notebooks (nbdev_test ${flags[*]:-}; slow cells skipped)"
start=$(date +%s)
timeout 420 nbdev_test "${paths[@]}" "${flags[@]}" --n_workers 4 --timing 2>&1 | tee "$OUT/cells.log" | tail -40
cells=${PIPESTATUS[0]}
cells_s=$(( $(date +%s) - start ))
failed=$(grep -A100 'nbdev Tests Failed On The Following Notebooks' "$OUT/cells.log" | grep -c '\.ipynb' || true)

bench=0
if [ "$REHEARSE" != 1 ]; then
  echo "== GPU benchmark (nanoserve bench gpu)"
  timeout 300 python3 -m nanoserve.cli bench gpu --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log" | tail -14
  bench=${PIPESTATUS[0]}
fi

echo "== summary"
printf '%-28s %s\n' 'notebooks' "$([ "$cells" = 0 ] && echo passed || echo "FAILED ($failed failed, exit $cells)") in ${cells_s} s"
if [ "$REHEARSE" != 1 ]; then
  printf '%-28s %s\n' 'GPU benchmark' "$([ "$bench" = 0 ] && echo 'ran (targets in the table above)' || echo "FAILED (exit $bench)")"
  grep -E 'met$' "$OUT/gpu_bench.log" || true
fi
exit $(( cells || bench ))
