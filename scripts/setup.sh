#!/usr/bin/env bash
# Creates .venv (or the venv given as $1) with torch and every smalti package installed editable, with test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
pip_install --upgrade pip
# The pinned torch: a CPU build from local disk on machines without a GPU, the CUDA build where there is one.
"$VENV/bin/python" -c "import torch" 2>/dev/null || pip_install "torch==2.13.0"
pip_install hatchling editables
args=()
for pkg in $("$VENV/bin/python" scripts/packages.py all); do
  case "$pkg" in
    core) args+=(-e "packages/core[mlflow,wandb,test]") ;;
    # bench: TRL, so the tests of bench/sft_vs_trl.py and bench/lora.py's chat part run rather than skip
    llm) args+=(-e "packages/llm[test,bench]") ;;
    *) if grep -q '^test *=' "packages/$pkg/pyproject.toml"; then args+=(-e "packages/$pkg[test]"); else args+=(-e "packages/$pkg"); fi ;;
  esac
done
# lint-imports: the import layering check; vulture: the dead-code scan (scripts/deadcode.py)
pip_install --no-build-isolation "${args[@]}" ruff "import-linter>=2.1" "vulture>=2.11"
# Azurite (the Azure Blob emulator smalti-storage's tests start) from npm into .tools/azurite, once.
if [ ! -x .tools/azurite/node_modules/.bin/azurite-blob ]; then
  if command -v npm >/dev/null; then
    npm install --prefix .tools/azurite --no-audit --no-fund --silent azurite@3 \
      || echo "warning: npm could not install Azurite; the az:// storage tests will be skipped"
  else
    echo "warning: npm not found, Azurite not installed; the az:// storage tests will be skipped"
  fi
fi
echo "set up $VENV with: $("$VENV/bin/python" scripts/packages.py all)"
