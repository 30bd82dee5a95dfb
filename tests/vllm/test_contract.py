"""What the plugin relies on in vLLM, pinned: the version series, the private runner methods it
overrides (names and parameters), the attributes it reads; and every configuration it refuses."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import vllm
from vllm.platforms import current_platform
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.worker.block_table import BlockTable, MultiGroupBlockTable
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_model_runner import ExecuteModelState, GPUModelRunner

import epikv.vllm
from epikv.policies.base import ModelInfo
from epikv.vllm.config import EpiKVSettings, Refused, check_engine

OVERRIDDEN = {
    "_update_states": ["self", "scheduler_output"],
    "_prepare_inputs": ["self", "scheduler_output", "num_scheduled_tokens"],
    "execute_model": ["self", "scheduler_output", "intermediate_tensors"],
    "get_kv_cache_spec": ["self"],
    "_get_eagle3_aux_layers_from_config": ["self"],
}


def test_vllm_is_the_pinned_series():
    assert vllm.__version__.startswith("0.32."), vllm.__version__


@pytest.mark.parametrize("name", sorted(OVERRIDDEN))
def test_overridden_runner_methods_keep_their_parameters(name):
    params = list(inspect.signature(getattr(GPUModelRunner, name)).parameters)
    assert params == OVERRIDDEN[name], f"GPUModelRunner.{name}{params}: the plugin's override must follow"


def test_what_the_plugin_reads_is_still_there():
    init = inspect.getsource(GPUModelRunner.__init__)
    for attr in (
        "self.seq_lens",
        "self.positions",
        "self.query_start_loc",
        "self.req_indices",
        "self.use_aux_hidden_state_outputs",
        "self.execute_model_state",
    ):
        assert attr in init, attr
    assert "aux_hidden_states" in ExecuteModelState._fields
    assert list(inspect.signature(CPUModelRunner.initialize_kv_cache).parameters)[:2] == [
        "self",
        "kv_cache_config",
    ]
    assert "CPUModelRunner(self.vllm_config" in inspect.getsource(CPUWorker.init_device)  # the swapped name
    assert list(inspect.signature(MultiGroupBlockTable.compute_slot_mapping).parameters) == [
        "self",
        "num_reqs",
        "query_start_loc",
        "positions",
    ]
    assert "num_blocks_per_row" in inspect.getsource(BlockTable.__init__)
    for name in ("get_num_blocks_to_allocate", "allocate_new_blocks"):
        assert list(inspect.signature(getattr(FullAttentionManager, name)).parameters)[1:3] == [
            "request_id",
            "num_tokens",
        ]
    assert {"preempted_req_ids", "finished_req_ids", "scheduled_new_reqs"} <= set(
        SchedulerOutput.__dataclass_fields__
    )
    source = inspect.getsource(Scheduler.__init__)
    assert "self.max_num_running_reqs =" in source and "self.max_num_active_reqs =" in source
    for name in ("check_and_update_config", "validate_request"):
        assert inspect.ismethod(getattr(type(current_platform), name))  # classmethods the plugin wraps


def config(**changes) -> SimpleNamespace:
    """A stand-in for VllmConfig with the fields ``check_engine`` reads (the plugin's defaults)."""
    hf = SimpleNamespace(num_attention_heads=9, num_hidden_layers=30, hidden_size=576, model_type="llama")
    c = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=hf, hf_config=hf, use_mla=False, model="m"),
        cache_config=SimpleNamespace(enable_prefix_caching=False, cache_dtype="auto"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        speculative_config=None,
        kv_transfer_config=None,
    )
    for path, value in changes.items():
        owner, field = path.split("__")
        setattr(getattr(c, owner) if owner != "vllm" else c, field, value)
    return c


MODEL = ModelInfo("m", 30, 9, 3, 64, 576)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"cache_config__enable_prefix_caching": True}, "prefix caching"),
        ({"vllm__speculative_config": object()}, "speculative decoding"),
        ({"parallel_config__pipeline_parallel_size": 2}, "pipeline parallelism"),
        ({"parallel_config__tensor_parallel_size": 2}, "tensor parallelism"),
        ({"cache_config__cache_dtype": "fp8"}, "fp8"),
        ({"model_config__use_mla": True}, "latent attention"),
        ({"scheduler_config__async_scheduling": True}, "async scheduling"),
        ({"vllm__kv_transfer_config": object()}, "KV connectors"),
    ],
)
def test_each_unsupported_setting_is_refused_with_one_line(change, words):
    spec = EpiKVSettings("streaming", 64).spec(MODEL)
    check_engine(config(), spec)  # the defaults pass
    with pytest.raises(Refused, match=words) as err:
        check_engine(config(**change), spec)
    assert "\n" not in str(err.value)


def test_models_with_sliding_windows_are_refused():
    c = config()
    c.model_config.hf_text_config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(Refused, match="sliding-window"):
        check_engine(c, EpiKVSettings("streaming", 64).spec(MODEL))


def test_recomputed_queries_are_refused_on_model_types_not_built():
    c = config()
    c.model_config.hf_config.model_type = "qwen3"  # query norm: not built in vLLM yet
    spec = EpiKVSettings("epikv", 256, params={"band_a": 10, "band_b": 20}).spec(MODEL)
    with pytest.raises(Refused, match="recomputes queries"):
        check_engine(c, spec)


@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv", "rkv", "thinkv", "raas"])
def test_attention_row_policies_are_refused_because_vllm_never_makes_the_matrix(policy):
    with pytest.raises(Refused, match="attention weights"):
        EpiKVSettings(policy, 256).spec(MODEL)


def test_settings_refuse_unknown_keys_by_name():
    with pytest.raises(Refused, match=r"'budgt'.*did you mean 'budget'"):
        EpiKVSettings.from_config({"epikv": {"policy": "epikv", "budgt": 12}})
    assert EpiKVSettings.from_config({"other": 1}) is None


def test_engine_kwargs_carry_the_settings_and_the_plugin_classes():
    kw = epikv.vllm.engine_kwargs(policy="streaming", budget=128, interval=4, n_sink=8)
    assert kw["additional_config"] == {
        "epikv": {"policy": "streaming", "budget": 128, "interval": 4, "params": {"n_sink": 8}}
    }
    assert kw["enable_prefix_caching"] is False
    assert kw["worker_cls"].endswith("EpiKVCPUWorker") and kw["scheduler_cls"].endswith("EpiKVScheduler")
    settings = EpiKVSettings.from_config(kw["additional_config"])
    spec = settings.spec(MODEL)
    assert (spec.policy.name, spec.budget, spec.interval, spec.policy.n_sink) == ("streaming", 128, 4, 8)
    assert set(epikv.vllm.vllm_policies()) >= {
        "epikv-segq",
        "epikv-flat",
        "streaming",
        "keydiff",
        "lagkv",
        "random",
        "full",
    }
