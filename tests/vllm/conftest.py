"""The vLLM plugin's tests: they run in vLLM's own environment (``bash scripts/setup.sh --vllm``, then
``.venv-vllm/bin/python -m pytest -q tests/vllm``) and are skipped where vLLM is not installed.

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine, scheduler and worker in the test's
own process, which also lets tests read the worker's state), float32, eager, blocks of 32 tokens.
epikv's own engine is the reference; it runs in epikv's environment (``.venv``, or
``EPIKV_REFERENCE_PYTHON``) in ``reference.py``'s worker, one per session, stopped at its end.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Beside another worker, one compute thread each (the reference worker inherits it): two
    # processes' OpenMP threads spinning on the same two cores ran the suite 1.6x slower than one.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
pytest.importorskip("vllm", reason="the vLLM plugin's tests run in .venv-vllm (setup.sh --vllm)")

from tests.vllm.engines import WORKER, reference

VLLM_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32, "num_hidden_layers": 3}
"""epikv's tiny shape, with heads of 32 (vLLM's CPU attention has no kernel for 16) and 3 layers."""
HYBRID_SHAPE = {
    kind: {"num_hidden_layers": 4, **extra}  # epikv's tiny layer types: sliding, global, sliding, global
    for kind, extra in {
        "gemma3_text": {"query_pre_attn_scalar": 32},  # scale queries by 1/sqrt(head_dim), as the table needs
        "gpt_oss": {},
        "exaone4": {},
        "olmo3": {},
        "smollm3": {},
    }.items()
}
STD = {"gemma3_text": 0.02}
"""Weight scale where 0.2 gives one token over and over (Gemma scales embeddings by sqrt(hidden))."""


TINY_KINDS = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "glm4_moe", "olmo2", "seed_oss",
    "gemma3_text", "exaone4", "gpt_oss", "olmo3", "smollm3",
)  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def reference_worker() -> Iterator[None]:
    """The session's reference worker (started by the first job) outlives no test: stopped here."""
    yield
    WORKER.close()


@pytest.fixture(scope="session", autouse=True)
def tiny(embedded: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """epikv's tiny model of every type, by type, built before any engine of the session starts: once
    vLLM's Transformers backend has loaded a model type, it has wrapped transformers' class of it for
    compilation, and the class builds only inside an engine from then on (9 s for all, here).
    ``served``: a Llama at 4,096 positions, the model of the server tests."""
    folders = {}
    for kind in TINY_KINDS:
        folder = tmp_path_factory.mktemp(f"tiny-{kind}")
        build_tiny(kind, folder, embedded["folder"])
        folders[kind] = str(folder)
    folder = tmp_path_factory.mktemp("tiny-served")
    build_tiny("llama", folder, embedded["folder"], positions=4096)
    folders["served"] = str(folder)  # the servers' model: Llama at 4,096 positions, chats in seconds
    return folders


def build_tiny(kind: str, folder: Path, tokenizer_folder: str, positions: int = 512) -> None:
    """epikv's tiny random model of ``kind`` saved in ``folder`` with the embedded model's tokenizer
    and chat template (so its vocabulary): heads of 32, weights at std 0.2 (biases too: Qwen2's
    q/k/v), so logits are far from flat and token comparisons mean something."""
    import torch
    from transformers import AutoTokenizer

    from epikv.models.tiny import tiny_model

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_folder))
    std = STD.get(kind, 0.2)
    shape = {**VLLM_SHAPE, **HYBRID_SHAPE.get(kind, {})}
    model = tiny_model(
        kind, vocab_size=vocab, initializer_range=std, max_position_embeddings=positions, **shape
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, std)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        source = f"{tokenizer_folder}/{name}"
        try:
            shutil.copy(source, folder / name)
        except FileNotFoundError:
            pass


@pytest.fixture(scope="session")
def embedded() -> dict[str, Any]:
    """The embedded model's folder and four chat prompts' ids (from epikv's own tokenizer)."""
    return reference("folder")
