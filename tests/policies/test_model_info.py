"""One owner per rule the hosts share (issue 58 item 5): epikv's engine, the vLLM plugin and the
eval's vLLM client read a model through ``ModelInfo.from_config``, so they cannot disagree on its
shape or its sliding layers; and whether a policy reads attention rows is ``Policy.reads_attention``."""

from __future__ import annotations

from types import SimpleNamespace

from epikv.integration import model_info
from epikv.policies.base import ModelInfo
from epikv.querypath import text_config
from epikv.vllm.config import model_info as plugin_model_info


def test_a_config_read_by_hand():
    hybrid = SimpleNamespace(
        num_attention_heads=8, num_hidden_layers=4, hidden_size=256, num_key_value_heads=2, head_dim=48,
        max_position_embeddings=4096, sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )  # fmt: skip
    assert ModelInfo.from_config(hybrid, "h") == ModelInfo(
        "h", 4, 8, 2, 48, 256, context_length=4096, sliding_layers=(0, 2), window=64
    )
    plain = SimpleNamespace(num_attention_heads=4, num_hidden_layers=2, hidden_size=64)
    assert ModelInfo.from_config(plain, "p") == ModelInfo("p", 2, 4, 4, 16, 64)  # MHA, hidden / heads


def test_both_hosts_read_a_model_through_the_one_builder(tiny_llama):
    config = text_config(tiny_llama)
    engine = model_info(tiny_llama)
    assert engine == ModelInfo.from_config(config, engine.identity)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=tiny_llama.config, hf_text_config=config, model="folder")
    )
    identity = getattr(tiny_llama.config, "epikv_model_id", None) or "folder"  # the plugin's naming
    assert plugin_model_info(vllm_config) == ModelInfo.from_config(config, identity)


def test_reads_attention_is_what_each_resolved_policy_asks_for():
    """``Policy.reads_attention`` (the plugin's and the study's one test of it) agrees with the
    attention layers every registered policy asks for once resolved."""
    from epikv.policies import policy_class, policy_names
    from epikv.spec import CacheSpec

    model = ModelInfo("m", 30, 9, 3, 64, 576)
    readers = set()
    for name in policy_names():
        cls = policy_class(name)
        params = {"band_a": 10, "band_b": 20} if cls.uses_bands else {}
        spec = CacheSpec.build(model, name, 256 if cls.evicts else None, params=params)
        asks = bool(spec.policy.needs().attention_layers)
        assert cls.reads_attention == spec.policy.reads_attention == asks, name
        if cls.reads_attention:
            readers.add(name)
    assert {"h2o", "tova", "snapkv", "rkv", "thinkv", "raas"} <= readers
    assert not readers & {"epikv-segq", "streaming", "keydiff", "full"}
