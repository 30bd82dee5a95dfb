"""The worker side: vLLM's V1 CPU model runner with EpiKV around its forward, and the worker that builds it.

Overrides (private methods of vLLM 0.32's V1 runner; pinned by ``tests/vllm/test_contract.py``):
``get_kv_cache_spec`` (the capped spec), ``initialize_kv_cache`` (find the page layout, build the
slot store), ``_get_eagle3_aux_layers_from_config`` (the band layers' hidden states, through the same
aux-hidden-state path EAGLE-3 uses), ``_update_states`` (request lifecycle), ``_prepare_inputs``
(physical lengths and slots), ``execute_model`` (observe and compact after the forward) and
``sample_tokens`` (each request's counters ride to the scheduler on the runner's output). Without
``additional_config["epikv"]`` every override passes straight through.
"""

from __future__ import annotations

import re
from typing import Any
from unittest import mock

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from epikv.vllm.compaction import SlotStore
from epikv.vllm.config import EpiKVSettings, Refused, check_engine, model_info
from epikv.vllm.paged import PagedKV, probe_layout
from epikv.vllm.queries import query_projector
from epikv.vllm.scheduler import capped_spec, register_spec
from epikv.vllm.step import EpiKVWorkerState


class EpiKVRunnerMixin:
    """EpiKV around a V1 model runner (see the module docstring)."""

    epikv: EpiKVWorkerState | None

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)  # type: ignore[call-arg]
        settings = EpiKVSettings.from_config(vllm_config.additional_config)
        self.epikv = None
        if settings is None:
            return
        register_spec()
        model = model_info(vllm_config)
        spec = settings.spec(model)
        check_engine(vllm_config, spec)
        self.epikv = EpiKVWorkerState(settings, spec, model)
        if self.epikv.aux_layers:
            self.use_aux_hidden_state_outputs = True

    def _get_eagle3_aux_layers_from_config(self) -> tuple[int, ...] | None:
        if self.epikv is not None and self.epikv.aux_layers:
            return self.epikv.aux_layers
        return super()._get_eagle3_aux_layers_from_config()  # type: ignore[misc]

    def get_kv_cache_spec(self) -> dict[str, Any]:
        specs = super().get_kv_cache_spec()  # type: ignore[misc]
        if self.epikv is None:
            return specs
        for name, spec in specs.items():
            if type(spec) is not FullAttentionSpec:
                raise Refused(f"epikv: layer {name} has a {type(spec).__name__}; only full attention evicts")
        return {name: capped_spec(spec, self.epikv.cap) for name, spec in specs.items()}

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)  # type: ignore[misc]
        if self.epikv is None:
            return
        layers = _attention_layers(self.compilation_config.static_forward_context)  # type: ignore[attr-defined]
        first = layers[0]
        pages = [layer.kv_cache for layer in layers]
        block, head_dim = pages[0].shape[2], pages[0].shape[3] // 2

        def write(key, value, key_pages, value_pages, slots):  # the backend's own writer
            ops.cpu_attn_reshape_and_cache(key, value, key_pages, value_pages, slots, first.isa)

        paged = PagedKV(pages, probe_layout(write, block, head_dim, pages[0].dtype))
        store = SlotStore(paged, self.epikv.spec, self.epikv.model, pages[0].shape[0] * block)
        if self.epikv.spec.policy.needs().query_layer is not None:
            store.project_queries = query_projector(self.model)  # type: ignore[attr-defined]
        self.epikv.store, self.epikv.block_size = store, block

    def _update_states(self, scheduler_output: Any) -> Any:
        if self.epikv is not None:
            self.epikv.before_update(scheduler_output)
        out = super()._update_states(scheduler_output)  # type: ignore[misc]
        if self.epikv is not None:
            self.epikv.after_update(scheduler_output)
        return out

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)  # type: ignore[misc]
        if self.epikv is not None and self.epikv.evicts:
            self.epikv.physical(self, num_scheduled_tokens)
        return out

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        out = super().execute_model(scheduler_output, intermediate_tensors)  # type: ignore[misc]
        state = self.execute_model_state  # type: ignore[attr-defined]
        if self.epikv is not None and state is not None:
            self.epikv.after_forward(self, state.aux_hidden_states)
        return out

    def sample_tokens(self, grammar_output: Any) -> Any:
        out = super().sample_tokens(grammar_output)  # type: ignore[misc]
        if self.epikv is not None and hasattr(out, "req_ids"):
            out.epikv = self.epikv.report  # travels to the scheduler with the output (pickled)
        return out


class EpiKVCPURunner(EpiKVRunnerMixin, CPUModelRunner):
    """vLLM's CPU model runner with EpiKV."""


class EpiKVCPUWorker(CPUWorker):
    """vLLM's CPU worker building :class:`EpiKVCPURunner` (``worker_cls``). The CPU worker builds its
    runner inline, so the runner class is swapped for the duration of that one call."""

    def init_device(self) -> None:
        if getattr(self, "use_v2_model_runner", False):
            raise Refused("epikv: vLLM's V2 model runner is not supported; set VLLM_USE_V2_MODEL_RUNNER=0")
        with mock.patch.object(cpu_worker, "CPUModelRunner", EpiKVCPURunner):
            super().init_device()


def _attention_layers(context: dict[str, Any]) -> list[Any]:
    """The model's attention layers in layer order (the modules holding ``kv_cache`` and ``isa``)."""
    found = []
    for name, module in context.items():
        match = re.search(r"layers\.(\d+)\.", name)
        if match and hasattr(module, "kv_cache") and hasattr(module, "isa"):
            found.append((int(match.group(1)), module))
    found.sort(key=lambda item: item[0])
    if not found or [i for i, _ in found] != list(range(len(found))):
        raise Refused(
            f"epikv: cannot find the model's attention layers in order (found {[i for i, _ in found]})"
        )
    return [module for _, module in found]
