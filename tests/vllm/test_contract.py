"""What the plugin relies on in vLLM, pinned (every name in :mod:`epikv.vllm.pins`, checked against
the classes actually subclassed and wrapped), and every configuration it refuses at start-up."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from types import SimpleNamespace

import pytest
import vllm
from vllm.platforms import current_platform

import epikv.vllm
from epikv.policies.base import ModelInfo
from epikv.vllm import pins
from epikv.vllm.config import EpiKVSettings, Refused
from epikv.vllm.plugin import register
from epikv.vllm.refusals import QUERY_MODELS, check_engine

register()  # as vLLM does in every process: the wrapped methods must still show vLLM's signatures


def resolve(path: str):
    module, name = path.split(":")
    value = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def test_vllm_is_a_pinned_version_and_any_other_is_refused_in_one_line():
    assert vllm.__version__ in pins.VLLM_VERSIONS, vllm.__version__
    assert pins.version_refusal(vllm.__version__) is None
    line = pins.version_refusal("0.32.1")
    assert line is not None and "0.32.1" in line and "0.32.0" in line and "\n" not in line


@pytest.mark.parametrize("owner", sorted({p.owner for p in pins.PINS}))
def test_every_records_owner_is_in_the_installed_vllm(owner):
    resolve(owner)  # the class, function, module object or constant the record names


@pytest.mark.parametrize("target", sorted(p.target for p in pins.PINS if p.check == "exists"))
def test_each_name_read_or_called_resolves(target):
    resolve(target)


@pytest.mark.parametrize("pin", [p for p in pins.PINS if p.check == "source"], ids=lambda p: p.target)
def test_each_name_found_in_vllms_source_is_still_there(pin):
    where, text = pin.source
    function = resolve(where)
    assert text in inspect.getsource(getattr(function, "__wrapped__", function)), f"{where}: no {text!r}"


@pytest.mark.parametrize(
    ("owner", "method"), [(owner, m) for owner, methods in pins.METHODS.items() for m in methods]
)
def test_each_overridden_or_wrapped_method_keeps_its_parameters(owner, method):
    cls = resolve(owner)
    function = getattr(cls, method)
    function = getattr(function, "__wrapped__", function)
    params = list(inspect.signature(function).parameters)
    want = pins.METHODS[owner][method]
    assert params[: len(want)] == want, f"{owner}.{method}{params}: the plugin's override must follow"


@pytest.mark.parametrize("path", sorted(pins.FUNCTIONS))
def test_each_called_function_keeps_its_parameters(path):
    params = list(inspect.signature(resolve(path)).parameters)
    want = pins.FUNCTIONS[path]
    assert params[: len(want)] == want, f"{path}{params}: the plugin's call must follow"


@pytest.mark.parametrize("owner", sorted(pins.INIT_ATTRS))
def test_each_class_still_sets_the_attributes_the_plugin_reads(owner):  # its __init__ or a base's
    inits = [c.__dict__["__init__"] for c in resolve(owner).__mro__ if "__init__" in c.__dict__]
    source = "".join(inspect.getsource(getattr(i, "__wrapped__", i)) for i in inits if inspect.isfunction(i))
    missing = [name for name in pins.INIT_ATTRS[owner] if f"self.{name}" not in source]
    assert not missing, f"{owner}.__init__ no longer sets {missing}"


@pytest.mark.parametrize("owner", sorted(pins.FIELDS))
def test_each_field_the_plugin_reads_is_still_there(owner):
    cls = resolve(owner)
    names = set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "__struct_fields__", ()))
    names |= set(getattr(cls, "_fields", ()))
    assert pins.FIELDS[owner] <= names, pins.FIELDS[owner] - names


def test_the_plugin_subclasses_and_wraps_exactly_the_pinned_classes():
    from epikv.vllm.runner import EpiKVCPURunner, EpiKVCPUWorker
    from epikv.vllm.scheduler import EpiKVAttentionManager, EpiKVAttentionSpec, EpiKVScheduler

    for ours, theirs in [
        (EpiKVCPURunner, "vllm.v1.worker.cpu_model_runner:CPUModelRunner"),
        (EpiKVCPUWorker, "vllm.v1.worker.cpu_worker:CPUWorker"),
        (EpiKVScheduler, "vllm.v1.core.sched.scheduler:Scheduler"),
        (EpiKVAttentionManager, "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager"),
        (EpiKVAttentionSpec, "vllm.v1.kv_cache_interface:FullAttentionSpec"),
    ]:
        vllm_class = resolve(theirs)
        assert vllm_class in ours.__mro__
        ours_only = [c for c in ours.__mro__ if c.__module__.startswith("epikv.")]
        overridden = {
            name
            for c in ours_only
            for name, value in vars(c).items()
            if callable(value)
            and hasattr(vllm_class, name)
            and (name == "__init__" or name[:2] != "__")
            and not (name == "__init__" and dataclasses.is_dataclass(c))  # the dataclass's own
        }
        assert overridden <= set(pins.METHODS[theirs]), (
            f"not pinned: {overridden - set(pins.METHODS[theirs])}"
        )
    worker = resolve("vllm.v1.worker.cpu_worker:CPUWorker")
    assert "CPUModelRunner(self.vllm_config" in inspect.getsource(worker.init_device)  # the swapped name
    assert inspect.ismethod(type(current_platform).check_and_update_config)  # a classmethod it wraps


def config(**changes) -> SimpleNamespace:
    """A stand-in for VllmConfig with the fields ``check_engine`` reads (the plugin's defaults)."""
    hf = SimpleNamespace(num_attention_heads=9, num_hidden_layers=30, hidden_size=576, model_type="llama")
    c = SimpleNamespace(
        model_config=SimpleNamespace(
            hf_text_config=hf, hf_config=hf, use_mla=False, model="m", architectures=["LlamaForCausalLM"],
            quantization=None, enable_prompt_embeds=False, model_impl="auto",
        ),
        cache_config=SimpleNamespace(enable_prefix_caching=False, cache_dtype="auto"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        speculative_config=None,
        kv_transfer_config=None,
        lora_config=None,
    )  # fmt: skip
    for path, value in changes.items():
        owner, field = path.split("__")
        setattr(getattr(c, owner) if owner != "vllm" else c, field, value)
    return c


MODEL = ModelInfo("m", 30, 9, 3, 64, 576)
SEGQ = EpiKVSettings("epikv", 256, params={"band_a": 10, "band_b": 20}).spec(MODEL)
STREAMING = EpiKVSettings("streaming", 64).spec(MODEL)


@pytest.mark.parametrize(
    ("spec", "change", "words"),
    [
        (STREAMING, {"cache_config__enable_prefix_caching": True}, "prefix caching is on"),
        (STREAMING, {"vllm__speculative_config": object()}, "speculative decoding"),
        (STREAMING, {"parallel_config__pipeline_parallel_size": 2}, "pipeline parallelism"),
        (STREAMING, {"parallel_config__tensor_parallel_size": 2}, "does not divide the model's 9 KV heads"),
        (STREAMING, {"cache_config__cache_dtype": "fp8"}, "fp8"),
        (STREAMING, {"model_config__use_mla": True}, "latent attention"),
        (STREAMING, {"scheduler_config__async_scheduling": True}, "async scheduling"),
        (STREAMING, {"vllm__kv_transfer_config": object()}, "KV connectors"),
        (STREAMING, {"model_config__enable_prompt_embeds": True}, "prompt embeddings"),
        (SEGQ, {"vllm__lora_config": object()}, "LoRA"),
        (SEGQ, {"model_config__quantization": "gptq"}, "'gptq' weights"),
    ],
)
def test_each_unsupported_setting_is_refused_with_one_line(spec, change, words):
    check_engine(config(), spec)  # the defaults pass
    with pytest.raises(Refused, match=words) as err:
        check_engine(config(**change), spec)
    assert "\n" not in str(err.value)


def test_a_patch_release_not_pinned_is_refused_in_one_line_naming_the_pinned_ones(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.32.1")  # the old prefix check let it through
    with pytest.raises(Refused, match=r"vLLM 0\.32\.1 is not supported.*0\.32\.0 exactly") as err:
        check_engine(config(), STREAMING)
    assert "\n" not in str(err.value)


def test_a_renamed_config_field_fails_loudly_not_as_a_dropped_refusal():
    c = config()
    del c.model_config.use_mla  # read with getattr(..., False) before: a rename skipped the refusal
    with pytest.raises(AttributeError, match="use_mla"):
        check_engine(c, STREAMING)


def test_prefix_caching_runs_for_policies_that_protect_the_prompt():
    assert SEGQ.policy.protect_prompt and not STREAMING.policy.protect_prompt
    check_engine(config(cache_config__enable_prefix_caching=True), SEGQ)
    check_engine(config(cache_config__enable_prefix_caching=True), EpiKVSettings("full").spec(MODEL))


def test_lora_and_quantized_weights_are_fine_without_recomputed_queries():
    check_engine(config(vllm__lora_config=object(), model_config__quantization="gptq"), STREAMING)


def test_alibi_models_are_refused_when_they_evict():
    c = config()
    c.model_config.hf_config.model_type = "bloom"
    with pytest.raises(Refused, match="ALiBi"):
        check_engine(c, STREAMING)
    check_engine(c, EpiKVSettings("full").spec(MODEL))  # nothing evicted: distances stay true


def test_a_non_cpu_platform_is_refused(monkeypatch):
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    with pytest.raises(Refused, match=r"platform is not supported.*GPU path is designed"):
        check_engine(config(), STREAMING)


def test_models_without_the_aux_hidden_state_path_are_refused_for_banded_policies():
    c = config()
    c.model_config.architectures = ["GPT2LMHeadModel"]  # in vLLM, without EAGLE-3's aux hidden states
    with pytest.raises(Refused, match="aux-hidden-state path"):
        check_engine(c, SEGQ)
    check_engine(c, STREAMING)  # reads no hidden state


def test_sliding_windows_outside_the_tables_hybrids_are_refused():
    c = config()
    c.model_config.hf_text_config.sliding_window = 64  # a Llama with a window: not a hybrid of the table
    with pytest.raises(Refused, match=r"'llama' with a sliding window \(sliding_window=64\)"):
        check_engine(c, STREAMING)
    c.model_config.hf_text_config.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(Refused, match=r"layer types .*chunked_attention"):
        check_engine(c, STREAMING)


def test_a_hybrid_runs_its_sliding_layers_unless_every_layer_slides():
    c = config()
    hf = c.model_config.hf_text_config
    hf.model_type, hf.sliding_window, hf.num_hidden_layers = "gemma3_text", 6, 4
    hf.layer_types = ["sliding_attention", "full_attention"] * 2
    c.model_config.architectures = ["Gemma3ForCausalLM"]
    check_engine(c, STREAMING)  # its global layers evict, its sliding ones stay vLLM's
    hf.layer_types = ["sliding_attention"] * 4
    with pytest.raises(Refused, match=r"sliding window in every layer .* no global layer to evict in"):
        check_engine(c, STREAMING)


def test_recomputed_queries_are_refused_on_model_types_not_built():
    c = config()
    c.model_config.hf_config.model_type = "gpt_bigcode"  # not in epikv's architecture table
    with pytest.raises(Refused, match="recomputes queries, built for model types"):
        check_engine(c, SEGQ)


def test_the_plugins_query_models_are_the_tables_non_hybrid_entries():
    from epikv.archs import ARCHITECTURES

    assert {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3"} <= QUERY_MODELS
    assert "gpt_oss" in QUERY_MODELS  # a hybrid whose every layer applies its own RoPE module
    assert not {"gemma3_text", "olmo3", "smollm3", "exaone4"} & QUERY_MODELS  # per-kind tables, NoPE
    assert QUERY_MODELS <= set(ARCHITECTURES)


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
    assert kw["enable_prefix_caching"] is False  # streaming may evict prompt tokens
    assert "enable_prefix_caching" not in epikv.vllm.engine_kwargs("epikv", 256)  # vLLM's default
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
