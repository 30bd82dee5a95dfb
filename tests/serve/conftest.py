"""The server tests' fixtures: a live server on 127.0.0.1 over a tiny random model with the embedded
tokenizer (the helpers are in :mod:`tests.helpers.serve`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from epikv.engine import SchedulerLimits
from epikv.integration import build_spec
from tests.helpers.models import TINY_BANDS as BANDS
from tests.helpers.serve import Live, start, stop


@pytest.fixture(scope="module")
def spec(serve_model) -> Any:
    return build_spec(serve_model, "epikv", 64, interval=8, params=BANDS)


@pytest.fixture(scope="module")
def live(serve_model, embedded_tokenizer, spec) -> Iterator[Live]:
    running = start(serve_model, embedded_tokenizer, spec, SchedulerLimits(max_waiting=16))
    yield running
    stop(running)
