"""The benchmarks' shared plumbing under its old name: a re-export, kept so that code written against
``epikv.bench.io`` keeps working. Each concept has its own module now; import from there:

- :mod:`epikv.bench.documents`: result documents and the :class:`Reporter`;
- :mod:`epikv.bench.machine`: machine facts, memory probes, synchronizer, threads;
- :mod:`epikv.bench.model_loading`: random-weight presets, their tokenizer, loading a bench model;
- :mod:`epikv.bench.figures`: the Agg figure factory;
- :mod:`epikv.bench.prompt_loading`: prompt texts and one prompt's token ids.

``encode_prompt_ids`` here is the old name of :func:`~epikv.bench.prompt_loading.prompt_token_ids`
(one text in); :func:`epikv.generation.encode_prompt_ids` is the batch tokeniser everything uses.
"""

from __future__ import annotations

from epikv.bench.documents import (
    SCHEMA_VERSION,
    TOP_LEVEL_KEYS,
    Reporter,
    config_dict,
    make_document,
    read_result,
    spec_record,
    write_result,
)
from epikv.bench.figures import new_figure, png_path, save_figure
from epikv.bench.machine import (
    QUIET_MALLOC,
    current_rss,
    load_average,
    machine_info,
    peak_rss,
    reset_peak_rss,
    set_threads,
    synchronizer,
    virtual_size,
)
from epikv.bench.model_loading import (
    RANDOM_PRESETS,
    ByteTokenizer,
    load_bench_model,
    model_name,
    page_in,
    random_model,
)
from epikv.bench.prompt_loading import encode_prompt, load_prompts, prompt_token_ids

encode_prompt_ids = prompt_token_ids  # the old name (one text in), for callers of this module

__all__ = [
    "QUIET_MALLOC", "RANDOM_PRESETS", "SCHEMA_VERSION", "TOP_LEVEL_KEYS", "ByteTokenizer", "Reporter",
    "config_dict", "current_rss", "encode_prompt", "encode_prompt_ids", "load_average",
    "load_bench_model", "load_prompts", "machine_info", "make_document", "model_name", "new_figure",
    "page_in", "peak_rss", "png_path", "prompt_token_ids", "random_model", "read_result",
    "reset_peak_rss", "save_figure", "set_threads", "spec_record", "synchronizer", "virtual_size",
    "write_result",
]  # fmt: skip
