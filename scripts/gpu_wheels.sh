#!/usr/bin/env bash
# Download, on a machine that reaches PyPI, the wheels that scripts/gpu_check.sh needs on a GPU machine that reaches
# no registry (it has torch, triton and transformers already): the test tools and the server's dependencies, for
# CPython 3.10-3.13 on x86-64 Linux, into .whl (ignored by git; carry it along with the working tree).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for py in 3.10 3.11 3.12 3.13; do
  pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
    nbdev==2.4.14 'execnb<0.2' 'fastcore<2' 'ghapi<2' hypothesis sortedcontainers attrs pytest pluggy iniconfig \
    fastapi starlette uvicorn pyzmq msgpack prometheus_client pydantic pydantic-core annotated-types typing-inspection \
    anyio sniffio h11 click asttokens watchdog httpx httpcore certifi idna openai distro jiter tqdm
done
ls .whl | wc -l
