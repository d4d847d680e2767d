#!/usr/bin/env bash
# On a machine with a CUDA GPU: run every `#| cuda` notebook cell, then the GPU benchmark, and print a short table.
# Budget: about 8 minutes on one H200.
#
# The lent GPU machine has torch, triton and transformers but reaches no package registry. If nbdev and the other
# test tools are missing there, bring them as wheels in ./.whl (ignored by git; see the device notes):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     nbdev==2.4.14 'execnb<0.2' 'fastcore<2' 'ghapi<2' hypothesis sortedcontainers attrs \
#     fastapi starlette uvicorn pyzmq msgpack prometheus_client pydantic pydantic-core annotated-types \
#     typing-inspection anyio sniffio h11 click asttokens watchdog
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/nanoserve-gpu-check}"; mkdir -p "$OUT"

if ! python3 -c 'import nbdev, hypothesis' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())' || exit 1

echo "== #| cuda cells (every notebook, cuda cells included; slow cells skipped)"
start=$(date +%s)
timeout 300 python3 -m nbdev.test --flags cuda --n_workers 4 --timing 2>&1 | tee "$OUT/cuda_cells.log" | tail -40
cells=${PIPESTATUS[0]}
echo "cuda cells: exit $cells in $(( $(date +%s) - start )) s"

echo "== GPU benchmark (nanoserve bench gpu: chapter 15)"
timeout 240 python3 -m nanoserve.cli bench gpu --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log" | tail -12
bench=${PIPESTATUS[0]}
exit $(( cells || bench ))
