#!/usr/bin/env bash
# The tests in two tiers: the fast tier (in-process, about a minute, two files at a time) first, then the slow one
# (real processes, CLI runs, servers), skipped if the fast one fails. Arguments go to both pytest calls (-x, a path).
# A tier that selects nothing (pytest's exit 5, e.g. a path holding only fast tests) is not a failure.
# Each tier's wall time is printed against its budget (the fast tier 60 s, the whole suite 15 min, on 2 cores);
# TEST_BUDGETS=enforce makes a run over budget fail.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
# Compiled modules are kept (__pycache__, ignored by git): the tiers start ~600 processes that import hsextract,
# and a machine that sets PYTHONDONTWRITEBYTECODE would compile its modules (and rewrite the tests) in each one.
unset PYTHONDONTWRITEBYTECODE
FAST_BUDGET_S=60
SUITE_BUDGET_S=900
over=0
# The slow tier runs three files at a time on two cores: its tests wait on processes, polls and servers, and a
# third file fills that idle time (measured on 2 cores: busy 95% of the tier with three files, 82% with two).
tier() {  # pytest workers, then the marker expression and the arguments
  local rc=0 workers=$1
  shift
  "$python" -m pytest -q -n "$workers" --dist loadfile -p no:cacheprovider -m "$@" || rc=$?
  if [[ $rc -ne 0 && $rc -ne 5 ]]; then exit $rc; fi
}
budget() {  # what, seconds taken, budget in seconds
  local verdict="within"
  if (( $2 > $3 )); then verdict="OVER"; over=1; fi
  local scope=""
  if [[ $selection -gt 0 ]]; then scope=" (arguments given: the budget is for the whole tier)"; fi
  printf 'budget: %s took %d s of %d s, %s%s\n' "$1" "$2" "$3" "$verdict" "$scope"
}
selection=$#
start=$SECONDS
tier 2 "not slow" "$@"
budget "the fast tier" $((SECONDS - start)) $FAST_BUDGET_S
tier 3 slow "$@"
budget "the whole suite" $((SECONDS - start)) $SUITE_BUDGET_S
if [[ $over -eq 1 && "${TEST_BUDGETS:-}" == "enforce" ]]; then
  echo "over budget (TEST_BUDGETS=enforce)" >&2
  exit 1
fi
