"""Plumbing every benchmark shares: result documents, machine facts, memory probes, models, figures.

A benchmark result is one JSON document::

    {"kind": "speed", "schema": 1, "created": "...", "config": {...}, "machine": {...}, "results": {...}}

written by :func:`write_result` and read back by :func:`read_result`; plots read only that file.
``config.cache_specs`` records every cache spec the run used (policy, budget, bands and the profile
they came from), gathered while it runs by a :class:`Reporter`, which also announces each one and
draws the benchmark's progress bar.
This module also owns the process-level memory probes (peak resident set on Linux, peak allocated
on CUDA), the named random-weight models that benchmarks and tests can load without a network
(``random:<preset>``), and the Agg figure factory. It knows no benchmark's figures.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import resource
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from epikv.models.tiny import config_from_spec, random_weights, tiny_spec

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from epikv.spec import CacheSpec

SCHEMA_VERSION = 1
TOP_LEVEL_KEYS = ("kind", "schema", "created", "config", "machine", "results")

# Random-weight models of known shapes: tests and machines without weights still run every kind.
# The tests' tiny shape, with room for the speed benchmark's long decodes (8192 positions, not 4096).
RANDOM_PRESETS: dict[str, dict[str, Any]] = {
    f"tiny-{arch}": tiny_spec(arch, max_position_embeddings=8192) for arch in ("llama", "qwen2")
}


# --------------------------------------------------------------------------- result documents


def load_average() -> list[float] | None:
    """The machine's 1/5/15-minute load averages (None where the OS has none): record it with timings."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """What the numbers were measured on: host, library versions, threads, load, accelerator."""
    import numpy
    import transformers

    import epikv

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": load_average(),
        "memory_total_bytes": _meminfo_total(),
        "python": platform.python_version(),
        "versions": {
            "epikv": epikv.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numpy": numpy.__version__,
        },
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        info["accelerator"] = {"name": props.name, "memory_bytes": props.total_memory}
    return info


def _meminfo_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def config_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as plain JSON-able data (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def spec_record(spec: CacheSpec) -> dict[str, Any]:
    """What a result keeps about one cache spec: its line (``describe``) and its resolved config
    (policy, budget, interval, attention, and the bands with the profile they came from)."""
    return {"describe": spec.describe(), **json.loads(json.dumps(spec.config()))}


class Reporter:
    """What a benchmark tells the person running it and keeps for its result: every cache spec it
    runs (recorded once each in ``specs``, and announced once through ``announce``) and, with
    ``progress``, a tqdm bar on stderr. The default shows nothing and still records."""

    def __init__(self, announce: Callable[[str], None] | None = None, progress: bool = False) -> None:
        self.announce, self.progress = announce, progress
        self.specs: list[dict[str, Any]] = []

    def bar(self, total: int, desc: str, unit: str = "it") -> tqdm:
        """A progress bar (a context manager; ``update(n)`` as work finishes), hidden unless ``progress``."""
        return tqdm(total=total, desc=f"bench {desc}", unit=unit, disable=not self.progress)

    def uses(self, spec: CacheSpec | dict[str, Any]) -> None:
        """A spec this run uses: a CacheSpec, or the :func:`spec_record` a subprocess sent back."""
        record = dict(spec) if isinstance(spec, dict) else spec_record(spec)
        if record not in self.specs:
            self.specs.append(record)
            if self.announce is not None:
                self.announce(record["describe"])


def make_document(
    kind: str,
    config: Any,
    results: dict[str, Any],
    device: str = "cpu",
    specs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The result document; ``specs`` (a Reporter's) go into the config as ``cache_specs``."""
    settings = config_dict(config) if dataclasses.is_dataclass(config) else dict(config)
    if specs is not None:
        settings["cache_specs"] = list(specs)
    return {
        "kind": kind,
        "schema": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": settings,
        "machine": machine_info(device),
        "results": results,
    }


def write_result(document: dict[str, Any], out_dir: str | os.PathLike[str]) -> Path:
    """Write ``OUT/<kind>.json`` atomically and return its path."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{document['kind']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def read_result(path: str | os.PathLike[str], kind: str | None = None) -> dict[str, Any]:
    """A result document, checked for the top-level keys (and the kind, when given)."""
    data = json.loads(Path(path).read_text())
    missing = [key for key in TOP_LEVEL_KEYS if key not in data]
    if missing:
        raise ValueError(f"{path} is not a benchmark result: missing {missing}")
    if kind is not None and data["kind"] != kind:
        raise ValueError(f"{path} holds a {data['kind']!r} result, expected {kind!r}")
    if data["schema"] != SCHEMA_VERSION:
        raise ValueError(f"{path} has schema {data['schema']}, this epikv reads {SCHEMA_VERSION}")
    return data


# --------------------------------------------------------------------------- memory probes


def _status_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# glibc settings for measured subprocesses: a fixed mmap threshold sends every large tensor to its
# own mapping, returned to the system when freed, so resident memory follows live tensors instead of
# the allocator's history (without it, repeated runs of one point differed by 30%).
QUIET_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}


def current_rss() -> int:
    """Resident set size now, in bytes (VmRSS; ru_maxrss where /proc is missing)."""
    value = _status_bytes("VmRSS")
    return value if value is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's resident high-water mark (VmHWM) to the current RSS; False if unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss() -> int:
    """Peak resident set since the last reset (VmHWM), else since the process started (ru_maxrss)."""
    value = _status_bytes("VmHWM")
    return value if value is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def virtual_size() -> int | None:
    return _status_bytes("VmSize")


def synchronizer(device: str | torch.device) -> Callable[[], None]:
    """A function that waits for queued work on ``device`` (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


# --------------------------------------------------------------------------- models


class ByteTokenizer:
    """Bytes folded into a small vocabulary, for random-weight models (no chat template, no files)."""

    chat_template = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.pad_token_id, self.eos_token_id = 0, 1

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [2 + b % (self.vocab_size - 2) for b in text.encode("utf-8")]}

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i % 95) for i in ids if not (skip_special_tokens and i < 2))


def random_model(
    preset: str | dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> torch.nn.Module:
    """A random-weight causal LM built from a preset name or a config dict (``model_type`` key)."""
    if isinstance(preset, str):
        if preset not in RANDOM_PRESETS:
            raise ValueError(f"unknown random model {preset!r} (known: {', '.join(sorted(RANDOM_PRESETS))})")
        spec, name = dict(RANDOM_PRESETS[preset]), preset
    else:
        spec, name = dict(preset), str(preset.get("name", "config"))
    spec.pop("name", None)
    config = config_from_spec(spec)
    return random_weights(config, seed, identity=f"random:{name}", dtype=dtype, device=device)


def load_bench_model(
    name: str | None, device: str = "cpu", dtype: str = "float32"
) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) for a benchmark: ``random:<preset>`` builds a random model, anything else
    goes through :func:`epikv.models.load_model` (None = the embedded model)."""
    torch_dtype = getattr(torch, dtype)
    if name is not None and name.startswith("random:"):
        model = random_model(name.split(":", 1)[1], dtype=torch_dtype, device=device)
        return model, ByteTokenizer(model.config.vocab_size)
    from epikv.models import load_model

    return load_model(name, dtype=torch_dtype, device=device if device != "cpu" else None)


def model_name(model: torch.nn.Module) -> str:
    from epikv.models import model_identity

    return model_identity(model)


def page_in(model: torch.nn.Module) -> None:
    """Run an 8-token forward so lazily mapped weights are resident before a memory baseline."""
    ids = torch.zeros(1, 8, dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)


def set_threads(threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- figures


def new_figure(width: float = 6.4, height: float = 4.2, ncols: int = 1) -> tuple[Figure, list[Axes]]:
    """A matplotlib figure on the Agg canvas (no GUI backend, no pyplot state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as err:
        raise ImportError("benchmark plots need matplotlib: pip install 'epikv[plot]'") from err
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, ncols)
    return figure, list(axes) if ncols > 1 else [axes]


def save_figure(figure: Figure, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    return out


def png_path(json_path: str | os.PathLike[str]) -> Path:
    return Path(json_path).with_suffix(".png")


# --------------------------------------------------------------------------- prompts


def load_prompts(source: str, count: int, offset: int = 0) -> list[str]:
    """Prompt texts: a bundled task (``math500``, ``gsm8k``... read from ``epikv/data``), a ``.jsonl``
    file (field ``problem``, ``prompt``, ``question`` or ``text``) or any text file (paragraphs)."""
    from importlib import resources

    bundled = resources.files("epikv").joinpath("data", f"{source}.jsonl")
    path = Path(source)
    if bundled.is_file():
        lines, where = bundled.read_text(encoding="utf-8").splitlines(), f"task {source!r}"
    elif path.is_file():
        lines, where = path.read_text(encoding="utf-8").splitlines(), str(path)
    else:
        raise FileNotFoundError(f"prompt source {source!r} is neither a bundled task nor a file")
    if source.endswith(".jsonl") or bundled.is_file():
        texts = [_prompt_field(json.loads(line), where) for line in lines if line.strip()]
    else:
        texts = [p.strip() for p in "\n".join(lines).split("\n\n") if p.strip()]
    chosen = texts[offset : offset + count]
    if not chosen:
        raise ValueError(f"{where} has no prompts at offset {offset}")
    return chosen


def _prompt_field(record: dict[str, Any], where: str) -> str:
    for key in ("problem", "prompt", "question", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    raise ValueError(f"{where}: a record has none of the fields problem/prompt/question/text")


def encode_prompt_ids(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids of one prompt, in the chat template when ``chat`` and the tokenizer has one."""
    from epikv.generation import encode_prompt_ids

    return encode_prompt_ids(tokenizer, [text], chat)[0]


def encode_prompt(tokenizer: Any, text: str, chat: bool = True) -> torch.Tensor:
    """Token ids (1, P) of one prompt (see :func:`encode_prompt_ids`)."""
    return torch.tensor([encode_prompt_ids(tokenizer, text, chat)], dtype=torch.long)
