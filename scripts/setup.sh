#!/usr/bin/env bash
# Creates .venv and installs hsextract into it (editable). `--test` adds the test tools (pytest, moto, ruff).
# torch is pinned to the release this project is tested with on CPU; on a GPU node install your CUDA build of
# torch first (and `pip install -e .[gpu]` for flash-linear-attention), then run this.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
if [[ "${1:-}" == "--test" ]]; then extras="[test]"; fi
if [[ ! -x .venv/bin/python ]]; then python3 -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".${extras}"
