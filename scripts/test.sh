#!/usr/bin/env bash
# Sets everything up and runs every package's tests, each package in a virtual environment that holds only
# that package, its declared smalti dependencies and its test extra; then the cross-package tests in tests/.
# One package (SMALTI_TEST_FROM_INSIDE, default health) runs from inside its own folder, as a user who checked
# out only that package would run it.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# A skip is allowed only for an optional extra, missing hardware or the platform (smalti.testing.skips lists the
# reasons); any other skip, such as one on a missing hard dependency, fails the suite. -rs lists every skip.
export SMALTI_STRICT_SKIPS=${SMALTI_STRICT_SKIPS:-1}
# Disk is shared with the rest of the machine; each package venv holds its own torch (about 1-2 GB), so say what is free.
echo "disk free before setup: $(df -h --output=avail . | tail -1 | tr -d ' ')"
bash scripts/setup.sh
.venv/bin/ruff check .
# Import layering (contracts in pyproject.toml's [tool.importlinter]): packages meet as ARCHITECTURE.md says and
# no package's modules import each other in a circle.
.venv/bin/lint-imports
# Dead code (vulture over packages/*/src; uses counted from the tests, bench/, configs' _target_s, entry points and
# scripts/deadcode_whitelist.py), then docstrings quoting measured figures (they belong in the READMEs).
.venv/bin/python scripts/source_checks.py
failed=()
root=$PWD
# One package's suite runs from inside its folder (cd packages/<pkg> && pytest), the others from the root.
from_inside=${SMALTI_TEST_FROM_INSIDE:-health}
# Two pytest workers (pytest-xdist, a dependency of smalti-testing) keep both cores busy while one test waits on
# its child processes; --dist loadfile keeps a file on one worker, so module-scoped reference runs happen once.
# SMALTI_TEST_WORKERS=0 runs each suite in one process; SMALTI_TEST_SERIAL="pkg ..." runs those packages' suites
# in one process (none by default).
workers=${SMALTI_TEST_WORKERS:-2}
serial_pkgs=" ${SMALTI_TEST_SERIAL:-} "
xdist_all=()
if [ "$workers" != 0 ]; then xdist_all=(-n "$workers" --dist loadfile); fi
for pkg in $(.venv/bin/python scripts/packages.py all); do
  [ -d "packages/$pkg/tests" ] || continue
  venv=".venvs/$pkg"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$venv/bin/python" -c "import torch" 2>/dev/null || "$venv/bin/python" -m pip install -q "torch==2.13.0"
  "$venv/bin/python" -m pip install -q hatchling editables
  # shellcheck disable=SC2046
  "$venv/bin/python" -m pip install -q --no-build-isolation $(.venv/bin/python scripts/packages.py closure "$pkg")
  xdist=("${xdist_all[@]}")
  if [[ "$serial_pkgs" == *" $pkg "* ]]; then xdist=(); fi
  echo "=== packages/$pkg (alone: $($venv/bin/python -m pip list 2>/dev/null | grep -c '^smalti-') smalti distributions) ==="
  if [ "$pkg" = "$from_inside" ]; then
    # As a user who checked out only this package runs its tests: from inside its folder (spawned children,
    # relative paths and the rootdir must work from there too).
    echo "    (run from inside packages/$pkg)"
    (cd "packages/$pkg" && "$root/$venv/bin/python" -m pytest -q -rs -p no:randomly --durations=8 "${xdist[@]}") || failed+=("$pkg")
  else
    "$venv/bin/python" -m pytest "packages/$pkg" -q -rs -p no:randomly --durations=8 "${xdist[@]}" || failed+=("$pkg")
  fi
  # In CI (a fresh clone) a package's venv is not needed again: free its disk before the next one is built, so the
  # run needs room for two environments at a time rather than nine. SMALTI_KEEP_VENVS=1 keeps them.
  if [ -n "${CI:-}" ] && [ -z "${SMALTI_KEEP_VENVS:-}" ]; then
    rm -rf "$venv"
  fi
done
if compgen -G "tests/test_*.py" > /dev/null; then
  echo "=== tests/ (all packages) ==="
  .venv/bin/python -m pytest tests -q -rs --durations=8 "${xdist_all[@]}" || failed+=("tests")
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all package test suites passed"
