#!/usr/bin/env bash
# Sets everything up, then trains the default small GPT (experiment=gpt_tiny) on the corpus shipped in the repository.
# Extra arguments are Hydra overrides, e.g.: bash scripts/train.sh trainer.max_duration=500ba logger=[console,jsonl]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/smalti-train experiment=gpt_tiny "$@"
