"""The one place that touches transformers internals: architecture table, hooks, query projection
and attention capture. Everything else in epikv sees models only through this package."""

from epikv.integration.arch import ARCHITECTURES, ArchFacts, check_supported, model_info, project_queries
from epikv.integration.hooks import (
    Attachment,
    active_hooks,
    attach,
    attention_implementation,
    build_spec,
)

__all__ = [
    "ARCHITECTURES",
    "ArchFacts",
    "Attachment",
    "active_hooks",
    "attach",
    "attention_implementation",
    "build_spec",
    "check_supported",
    "model_info",
    "project_queries",
]
