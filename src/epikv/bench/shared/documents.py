"""Result documents: the one JSON file a benchmark writes and its plots read back.

A benchmark result is one JSON document::

    {"kind": "speed", "schema": 1, "created": "...", "config": {...}, "machine": {...}, "results": {...}}

written by :func:`write_result` and read back by :func:`read_result`; plots read only that file.
``config.cache_specs`` records every cache spec the run used (policy, budget, bands and the profile
they came from), gathered while it runs by a :class:`Reporter`, which also announces each one and
draws the benchmark's progress bar. What ``machine`` holds is :mod:`epikv.bench.shared.machine`'s.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from epikv.bench.shared.machine import machine_info

if TYPE_CHECKING:
    from epikv.spec import CacheSpec

SCHEMA_VERSION = 1
TOP_LEVEL_KEYS = ("kind", "schema", "created", "config", "machine", "results")


def config_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as plain JSON-able data (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def spec_record(spec: CacheSpec) -> dict[str, Any]:
    """What a result keeps about one cache spec: its line (``describe``) and its resolved config
    (policy, budget, interval, attention, and the bands with the profile they came from)."""
    return spec.record()


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
