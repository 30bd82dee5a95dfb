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

import copy
import re
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.distributed import get_tp_group
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from epikv.vllm.compaction import HeadShards, SlotStore
from epikv.vllm.config import EpiKVSettings, Refused, model_info
from epikv.vllm.paged import PagedKV, probe_layout
from epikv.vllm.queries import query_projector
from epikv.vllm.refusals import check_engine
from epikv.vllm.scheduler import EpiKVAttentionSpec, capped_spec, register_spec
from epikv.vllm.step import EpiKVWorkerState, NewRequest, StepBatch


class EpiKVCPURunner(CPUModelRunner):
    """vLLM's CPU model runner with EpiKV around its forward (see the module docstring)."""

    epikv: EpiKVWorkerState | None
    epikv_group = 0  # the KV cache group of the global layers (the one that evicts)
    epikv_dropped: torch.Tensor | None = None  # this step's tokens evicted per row (None: none)

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        settings = EpiKVSettings.from_config(vllm_config.additional_config)
        self.epikv = None
        if settings is None:
            return
        register_spec()
        model = model_info(vllm_config)
        spec = settings.spec(model)
        check_engine(vllm_config, spec)
        first = get_tp_group().rank_in_group == 0
        self.epikv = EpiKVWorkerState(settings, spec, model, first, vllm_config.model_config.max_model_len)
        if self.epikv.aux_layers:
            self.use_aux_hidden_state_outputs = True

    def _get_eagle3_aux_layers_from_config(self) -> tuple[int, ...] | None:
        if self.epikv is not None and self.epikv.aux_layers:
            return self.epikv.aux_layers
        return super()._get_eagle3_aux_layers_from_config()

    def get_kv_cache_spec(self) -> dict[str, Any]:
        """Global layers get the capped spec; a hybrid's sliding layers keep vLLM's own spec (their
        own manager, window and kernels: compaction never touches them)."""
        specs = super().get_kv_cache_spec()
        if self.epikv is None:
            return specs
        model, out = self.epikv.model, {}
        for name, spec in specs.items():
            sliding = _layer_index(name) in model.sliding_layers
            if sliding and type(spec) is SlidingWindowSpec and spec.sliding_window == model.window:
                out[name] = spec
            elif not sliding and type(spec) is FullAttentionSpec:
                out[name] = capped_spec(spec, self.epikv.cap)
            else:
                kind = f"a sliding window of {model.window}" if sliding else "full attention"
                raise Refused(
                    f"epikv: layer {name} has a {type(spec).__name__} in vLLM, where the model's config "
                    f"says {kind}; only full attention evicts"
                )
        return out

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if self.epikv is None:
            return
        model = self.epikv.model
        groups = kv_cache_config.kv_cache_groups
        evicting = [g for g, gr in enumerate(groups) if isinstance(gr.kv_cache_spec, EpiKVAttentionSpec)]
        names = groups[evicting[0]].layer_names if len(evicting) == 1 else []
        if {_layer_index(name) for name in names} != set(model.cache_layers):
            raise Refused(
                f"epikv: vLLM grouped the model's global layers {list(model.cache_layers)} into "
                f"{len(evicting)} KV cache groups; the plugin compacts exactly one group holding all of them"
            )
        self.epikv_group = group = evicting[0]
        for attn_group in self.attn_groups[group]:
            for builder in attn_group.metadata_builders:
                builder.build = _physical_lengths(builder.build, self)
        every = _attention_layers(self.compilation_config.static_forward_context)
        layers = [every[i] for i in model.cache_layers]
        first = layers[0]
        pages = [layer.kv_cache for layer in layers]
        block, head_dim = pages[0].shape[2], pages[0].shape[3] // 2

        def write(key, value, key_pages, value_pages, slots):  # the backend's own writer
            ops.cpu_attn_reshape_and_cache(key, value, key_pages, value_pages, slots, first.isa)

        paged = PagedKV(pages, probe_layout(write, block, head_dim, pages[0].dtype))
        store = SlotStore(paged, self.epikv.spec, model, pages[0].shape[0] * block)
        if self.epikv.spec.policy.needs().query_layer is not None:
            store.project_queries = query_projector(
                self.model,
                self.model_config.hf_config.model_type,
            )
        tp = get_tp_group()
        if tp.world_size > 1:
            store.shards = _head_shards(tp, paged.num_heads)
        self.epikv.store, self.epikv.block_size = store, block

    def _update_states(self, scheduler_output: Any) -> Any:
        out_ = scheduler_output
        if self.epikv is not None:
            gone = set(out_.preempted_req_ids or ()) | set(out_.scheduled_cached_reqs.resumed_req_ids)
            self.epikv.before_update(list(out_.finished_req_ids), sorted(gone))
        out = super()._update_states(scheduler_output)
        if self.epikv is not None:
            self.epikv.after_update([_new_request(new) for new in out_.scheduled_new_reqs])
        return out

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self.epikv_dropped = None
        if self.epikv is not None and self.epikv.evicts:
            self._physical(num_scheduled_tokens)
        return out

    def _physical(self, scheduled: np.ndarray) -> None:
        """The evicting group's attention lengths and slots become physical (positions stay logical,
        and a hybrid's sliding groups keep vLLM's logical lengths and slots); a faulted row's tokens
        are written nowhere in the evicting group (vLLM's writer skips slot -1)."""
        assert self.epikv is not None
        batch = self._step_batch(scheduled)
        dropped, bad = self.epikv.physical(batch)
        if not dropped.any() and not bad.any():
            return
        n, total = len(batch.ids), int(batch.starts[-1])
        self.epikv_dropped = torch.from_numpy(dropped)  # read by the group's metadata builders
        rows = self.req_indices.np[:total]
        physical = batch.positions[:total] - torch.from_numpy(dropped[rows])
        table = self.input_batch.block_table[self.epikv_group]
        table.compute_slot_mapping(n, self.query_start_loc.gpu[: n + 1], physical)
        if bad.any():
            table.slot_mapping.gpu[:total][torch.from_numpy(bad[rows])] = -1

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        out = super().execute_model(scheduler_output, intermediate_tensors)
        self.epikv_dropped = None  # built into this step's metadata; a dummy run must not see it
        state = self.execute_model_state
        if self.epikv is not None and state is not None:
            batch = self._step_batch(scheduler_output.num_scheduled_tokens, written=True)
            self.epikv.after_forward(batch, state.aux_hidden_states)
        return out

    def sample_tokens(self, grammar_output: Any) -> Any:
        out = super().sample_tokens(grammar_output)
        if self.epikv is not None and hasattr(out, "req_ids") and out is not EMPTY_MODEL_RUNNER_OUTPUT:
            out.epikv, out.epikv_faults = self.epikv.take()  # travel to the scheduler (pickled)
        return out

    def _step_batch(self, scheduled: Any, written: bool = False) -> StepBatch:
        """This step's rows, read from vLLM's runner and input batch (the one place that does)."""
        batch = self.input_batch
        n = batch.num_reqs
        ids = list(batch.req_ids[:n])
        if isinstance(scheduled, dict):  # after the forward: the scheduler's per-request counts
            scheduled = np.array([scheduled[r] for r in ids], dtype=np.int64)
        starts = self.query_start_loc.np[: n + 1].astype(np.int64)
        table = batch.block_table[self.epikv_group]
        return StepBatch(
            ids=ids,
            computed=batch.num_computed_tokens_cpu[:n].astype(np.int64),
            prompts=batch.num_prompt_tokens[:n].astype(np.int64),
            scheduled=np.asarray(scheduled[:n], dtype=np.int64),
            starts=starts,
            room=table.num_blocks_per_row[:n].astype(np.int64) * self.epikv.block_size,  # type: ignore[union-attr]
            positions=self.positions[: int(starts[n])],
            slots=table.slot_mapping.gpu[: int(starts[n])].long() if written else None,
            blocks=lambda req_id: self.requests[req_id].block_ids[self.epikv_group],
        )


def _new_request(new: Any) -> NewRequest:
    params = new.sampling_params
    return NewRequest(
        req_id=new.req_id,
        prompt=None if new.prompt_token_ids is None else len(new.prompt_token_ids),
        cached=int(new.num_computed_tokens),
        max_tokens=params.max_tokens if params is not None else None,
        extra_args=params.extra_args if params is not None else None,
    )


class EpiKVCPUWorker(CPUWorker):
    """vLLM's CPU worker building :class:`EpiKVCPURunner` (``worker_cls``). The CPU worker builds its
    runner inline, so the runner class is swapped for the duration of that one call."""

    def init_device(self) -> None:
        if self.use_v2_model_runner:  # read, not probed: a rename fails loudly here (pins.INIT_ATTRS)
            raise Refused("epikv: vLLM's V2 model runner is not supported; set VLLM_USE_V2_MODEL_RUNNER=0")
        with mock.patch.object(cpu_worker, "CPUModelRunner", EpiKVCPURunner):
            super().init_device()


def _head_shards(tp: Any, heads: int) -> HeadShards:
    """This rank's share of the heads, and the collectives of vLLM's tensor-parallel group: gathers
    and the score broadcast on its own group, the small agreements (an element-wise max, every rank's
    lines) on its CPU group."""

    def union(flags: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=tp.cpu_group)
        return flags

    def objects(x: Any) -> list[Any]:
        out: list[Any] = [None] * tp.world_size
        torch.distributed.all_gather_object(out, x, group=tp.cpu_group)
        return out

    lo = tp.rank_in_group * heads
    return HeadShards(lo, lo + heads, tp.all_gather, lambda t: tp.broadcast(t, 0), union, objects)


_LAYER = re.compile(r"layers\.(\d+)\.")


def _physical_lengths(build: Callable[..., Any], runner: EpiKVCPURunner) -> Callable[..., Any]:
    """A metadata builder of the evicting group that sees each row's physical length (logical minus
    what the row has evicted): vLLM shares one ``seq_lens`` across KV cache groups, and a hybrid's
    sliding layers need the logical one."""

    def physical(common_prefix_len: int, common: Any, *args: Any, **kwargs: Any) -> Any:
        dropped = runner.epikv_dropped
        if dropped is not None:
            common = copy.copy(common)
            common.seq_lens = common.seq_lens.clone()
            common.seq_lens[: dropped.shape[0]] -= dropped.to(common.seq_lens.dtype)
        return build(common_prefix_len, common, *args, **kwargs)

    return physical


def _layer_index(name: str) -> int:
    """The decoder layer of an attention module's name (``model.layers.3.self_attn.attn`` -> 3)."""
    match = _LAYER.search(name)
    if match is None:
        raise Refused(f"epikv: cannot tell which decoder layer attention module {name!r} belongs to")
    return int(match.group(1))


def _attention_layers(context: dict[str, Any]) -> list[Any]:
    """The model's attention layers in layer order (the modules holding ``kv_cache`` and ``isa``)."""
    found = sorted(
        ((_layer_index(name), module) for name, module in context.items()
         if _LAYER.search(name) and hasattr(module, "kv_cache") and hasattr(module, "isa")),
        key=lambda item: item[0],
    )  # fmt: skip
    if not found or [i for i, _ in found] != list(range(len(found))):
        raise Refused(
            f"epikv: cannot find the model's attention layers in order (found {[i for i, _ in found]})"
        )
    return [module for _, module in found]
