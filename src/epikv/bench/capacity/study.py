"""Capacity arithmetic (paper Fig. 6): how many requests fit on one accelerator, with and without a budget.

Pure arithmetic, nothing measured. For a model's KV shape the bytes per cached token are
b = 2 * layers * kv_heads * head_dim * dtype_bytes (keys and values), and the concurrent requests at
context n are ``floor((M * u - W) / (n * b))`` for an accelerator of M bytes, usable fraction u and
weights W. A budget K caps each request at K (+ ``slack`` tokens held between compactions, 0 in the
paper's arithmetic) tokens. Every assumption is a field of :class:`CapacityConfig`; GB means 2**30
bytes, as in the paper's numbers (128 KiB/token, 458.7k tokens of KV on 80 GB).

This module owns the arithmetic, the model shapes it reads (presets of the paper's models, a hub
id or folder through ``AutoConfig``, or the embedded model) and the capacity figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epikv.bench.shared import documents, figures, model_loading

GIB = 1 << 30

# Shapes of the paper's models (public config.json values), so the arithmetic runs offline.
PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}
ALIASES = {
    "llama-8b": "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
    "qwen-7b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "qwen-1.5b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
}


@dataclass(frozen=True)
class CapacityConfig:
    """The paper's Fig. 6 assumptions by default (Llama-8B, bf16, 80 GB, 90% usable, 16 GB weights).

    weights_gb None = parameters x dtype_bytes from the model's shape."""

    model: str = "llama-8b"
    gpu_gb: float = 80.0
    usable: float = 0.9
    weights_gb: float | None = 16.0
    dtype_bytes: int = 2
    contexts: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536, 131072)
    budgets: tuple[int, ...] = (2048, 4096)
    slack: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.usable <= 1:
            raise ValueError(f"usable must be in (0, 1], got {self.usable}")
        if self.gpu_gb <= 0 or self.dtype_bytes <= 0:
            raise ValueError(
                f"gpu_gb and dtype_bytes must be positive, got {self.gpu_gb}, {self.dtype_bytes}"
            )
        if any(n <= 0 for n in (*self.contexts, *self.budgets)) or self.slack < 0:
            raise ValueError("contexts and budgets must be positive and slack >= 0")


QUICK = CapacityConfig()  # pure arithmetic: the paper's configuration is already instant


@dataclass(frozen=True)
class KVShape:
    """What the arithmetic needs from a model config."""

    layers: int
    kv_heads: int
    head_dim: int
    parameters: int


def kv_bytes_per_token(shape: KVShape, dtype_bytes: int) -> int:
    """Keys and values of one token over all layers: 2 * layers * kv_heads * head_dim * bytes."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes


def max_requests(
    gpu_bytes: float, usable: float, weight_bytes: float, tokens: int, bytes_per_token: int
) -> int:
    """floor((M * u - W) / (tokens * b)), never below 0."""
    free = gpu_bytes * usable - weight_bytes
    return max(0, math.floor(free / (tokens * bytes_per_token)))


def estimate_parameters(config: Any) -> int:
    """Decoder-only parameter count from a config: embeddings, attention, gated MLP, norms."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * head_dim * (heads * 2 + kv_heads * 2)
    mlp = 3 * hidden * config.intermediate_size
    embeddings = config.vocab_size * hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return layers * (attention + mlp + 2 * hidden) + embeddings + hidden


def shape_from_config(config: Any) -> KVShape:
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    return KVShape(
        layers=config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        parameters=estimate_parameters(config),
    )


def load_config(name: str) -> Any:
    """A model config: a preset (alias or hub id), the embedded model, or AutoConfig on an id/folder."""
    from types import SimpleNamespace

    key = ALIASES.get(name, name)
    if key in PRESETS:
        return SimpleNamespace(**PRESETS[key])
    from epikv.models import is_embedded_name

    if is_embedded_name(name):
        model, _ = model_loading.load_bench_model(None)
        return model.config
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except OSError as err:
        raise ValueError(f"cannot read the config of {name!r}: {err}") from err


def capacity_table(shape: KVShape, config: CapacityConfig) -> dict[str, Any]:
    """Bytes per token and requests per context, without eviction and at each budget."""
    per_token = kv_bytes_per_token(shape, config.dtype_bytes)
    gpu = config.gpu_gb * GIB
    weights = (
        config.weights_gb * GIB if config.weights_gb is not None else shape.parameters * config.dtype_bytes
    )
    rows = []
    for context in config.contexts:
        row: dict[str, Any] = {
            "context": context,
            "full": max_requests(gpu, config.usable, weights, context, per_token),
        }
        for budget in config.budgets:
            held = min(context, budget + config.slack)
            row[f"K={budget}"] = max_requests(gpu, config.usable, weights, held, per_token)
        rows.append(row)
    return {
        "shape": shape.__dict__,
        "kv_bytes_per_token": per_token,
        "weights_bytes": weights,
        "kv_pool_tokens": max(0.0, gpu * config.usable - weights) / per_token,
        "rows": rows,
    }


def run_capacity(config: CapacityConfig, reporter: documents.Reporter | None = None) -> dict[str, Any]:
    """The capacity document for ``config`` (see :mod:`epikv.bench.shared.documents` for the
    envelope). Arithmetic only: no cache runs, so it records no cache specs."""
    reporter = reporter or documents.Reporter()
    with reporter.bar(1, "capacity", unit="table") as bar:
        shape = shape_from_config(load_config(config.model))
        table = capacity_table(shape, config)
        bar.update()
    return documents.make_document("capacity", config, table, specs=reporter.specs)


def plot_capacity(json_path: str | Path, png: str | Path | None = None) -> Path:
    """Requests vs context (log-log), one line per budget, from the JSON alone."""
    data = documents.read_result(json_path, "capacity")
    results, cfg = data["results"], data["config"]
    figure, (axes,) = figures.new_figure()
    contexts = [row["context"] for row in results["rows"]]
    series = [key for key in results["rows"][0] if key != "context"]
    for index, key in enumerate(series):
        values = [row[key] for row in results["rows"]]
        label = "no eviction" if key == "full" else key
        axes.plot(contexts, values, marker="o", color=f"C{index}", label=label)
        for x, y in zip(contexts, values, strict=True):
            axes.annotate(str(y), (x, y), textcoords="offset points", xytext=(0, 5), fontsize=7, ha="center")
    axes.set_xscale("log", base=2)
    axes.set_yscale("symlog", linthresh=1)  # 0 requests must stay drawable
    top = max(max(row[key] for key in series) for row in results["rows"])
    axes.set_ylim(0, max(2, top) * 2.5)
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel("max concurrent requests")
    kib = results["kv_bytes_per_token"] / 1024
    axes.set_title(
        f"{cfg['model']}: {kib:g} KiB/token, {cfg['gpu_gb']:g} GB x {cfg['usable']:g}, "
        f"W={results['weights_bytes'] / GIB:.1f} GB",
        fontsize=9,
    )
    axes.legend()
    return figures.save_figure(figure, png or figures.png_path(json_path))
