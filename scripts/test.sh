#!/usr/bin/env bash
# The tests in two tiers, two files at a time: the fast tier (in-process, about a minute) first, then the slow one
# (real processes, CLI runs, servers), skipped if the fast one fails. Arguments go to both pytest calls (-x, a path).
# A tier that selects nothing (pytest's exit 5, e.g. a path holding only fast tests) is not a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
# Compiled modules are kept (__pycache__, ignored by git): the tiers start ~600 processes that import hsextract,
# and a machine that sets PYTHONDONTWRITEBYTECODE would compile its modules (and rewrite the tests) in each one.
unset PYTHONDONTWRITEBYTECODE
tier() {
  local rc=0
  "$python" -m pytest -q -n 2 --dist loadfile -p no:cacheprovider -m "$@" || rc=$?
  if [[ $rc -ne 0 && $rc -ne 5 ]]; then exit $rc; fi
}
tier "not slow" "$@"
tier slow "$@"
