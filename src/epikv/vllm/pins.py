"""Every vLLM name the plugin relies on, written once: the supported version, each method it overrides
or wraps (with the leading parameters it relies on), and each attribute or field it reads.
``tests/vllm/test_contract.py`` iterates these against the classes actually subclassed and wrapped,
and ``tests/vllm/test_engine.py`` reads the instance attributes off a live engine, so a vLLM release
that moves any of them fails a test, not a server. Imports nothing of vLLM.
"""

from __future__ import annotations

VLLM_SERIES = "0.32."  # the private runner and scheduler methods overridden are pinned to this series

# class (module:qualname) -> {method: the leading parameters the override or wrapper relies on}
# Each entry says why the plugin touches it and what would retire it.
METHODS: dict[str, dict[str, list[str]]] = {
    # the runner (runner.EpiKVRunnerMixin): the capped KV spec, the worker's books per request, physical
    # slots before the forward, observe/compact after it; retire when vLLM has a KV-eviction hook in
    # its runner (a per-request "compact" step between forwards)
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner": {
        "__init__": ["self", "vllm_config", "device"],
        "_update_states": ["self", "scheduler_output"],
        "_prepare_inputs": ["self", "scheduler_output", "num_scheduled_tokens"],
        "execute_model": ["self", "scheduler_output", "intermediate_tensors"],
        "sample_tokens": ["self", "grammar_output"],
        "get_kv_cache_spec": ["self"],
        "initialize_kv_cache": ["self", "kv_cache_config"],
        "_get_eagle3_aux_layers_from_config": ["self"],
    },
    # the worker builds its runner inline: swapped for that one call; retire with a runner-class option
    "vllm.v1.worker.cpu_worker:CPUWorker": {"init_device": ["self"]},
    # called on the evicting group's own table (runner: slots from physical positions); retire when
    # vLLM's block table can take per-row position offsets
    "vllm.v1.worker.block_table:BlockTable": {
        "compute_slot_mapping": ["self", "num_reqs", "query_start_loc", "positions"],
    },
    # wrapped on each builder of the evicting group (runner._physical_lengths: attention lengths are
    # physical there, logical in a hybrid's sliding groups); a drift here is silently wrong attention
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder": {
        "build": ["self", "common_prefix_len", "common_attn_metadata"],
    },
    # admission by reservation, per-request plans, faults failing alone, counters on outputs
    # (scheduler.EpiKVScheduler); retire when vLLM's scheduler takes a per-request token cap
    "vllm.v1.core.sched.scheduler:Scheduler": {
        "__init__": ["self", "vllm_config", "kv_cache_config"],
        "add_request": ["self", "request"],
        "update_from_output": ["self", "scheduler_output", "model_runner_output"],
        "_preempt_request": ["self", "request", "timestamp", "drop_stale_output"],
        "_free_request": ["self", "request", "delay_free_blocks"],
        "finish_requests": ["self", "request_ids", "finished_status"],
    },
    # all of a request's reserved blocks at its first allocation, never more; only prompt blocks cached
    # (scheduler.EpiKVAttentionManager, registered through vLLM's KV-cache-spec registry)
    "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager": {
        "get_num_blocks_to_allocate": ["self", "request_id", "num_tokens"],
        "allocate_new_blocks": ["self", "request_id", "num_tokens", "num_tokens_main_model"],
        "cache_blocks": ["self", "request", "num_tokens"],
    },
    # the front end's 400s (plugin._wrap_inputs); retire when vLLM validates extra_args by plugin
    "vllm.v1.engine.input_processor:InputProcessor": {"process_inputs": ["self"]},
    # per-request counters into Prometheus metrics and failed requests' lines (plugin._wrap_outputs)
    "vllm.v1.engine.output_processor:OutputProcessor": {
        "process_outputs": ["self", "engine_core_outputs"],
        "_update_stats_from_finished": ["self", "req_state", "finish_reason"],
        "abort_requests": ["self", "request_ids", "internal"],
    },
    # give each engine's output processor its counters, its input processor the pool (plugin._after_init)
    "vllm.v1.engine.async_llm:AsyncLLM": {"__init__": ["self", "vllm_config"]},
    "vllm.v1.engine.llm_engine:LLMEngine": {"__init__": ["self", "vllm_config"]},
    # beam search refused per request (each beam step re-prefills: nothing would be evicted)
    "vllm.entrypoints.generate.beam_search.offline:BeamSearchOfflineMixin": {"beam_search": ["self"]},
    "vllm.entrypoints.generate.beam_search.online:BeamSearchOnlineMixin": {"beam_search": ["self"]},
    # the streamed chat's and completion's finishing chunk carries the counters (plugin._tap_stream);
    # retire when vLLM streams kv_transfer_params itself
    "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat": {
        "chat_completion_stream_generator": ["self", "request", "result_generator"],
    },
    "vllm.distributed.parallel_state:GroupCoordinator": {  # called, not overridden (tensor parallelism)
        "all_gather": ["self", "input_", "dim"],
        "broadcast": ["self", "input_", "src"],
    },
    # called: the capped spec's manager registered beside full attention (scheduler.register_spec);
    # ``_ensure_registered`` loads vLLM's own entries first, so ours is not overwritten by them
    "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry": {
        "_ensure_registered": ["vllm_config"],
        "register": ["kvcache_spec_cls", "manager_class", "uniform_type_base_spec"],
    },
    "vllm.model_executor.models.registry:_ModelRegistry": {  # called (start-up refusals)
        "resolve_model_cls": ["self", "architectures", "model_config"],
    },
    "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion": {
        "completion_stream_generator": ["self", "request", "engine_inputs", "result_generator"],
    },
    # a failed request's 500 carries the epikv line (plugin._wrap_errors); retire when vLLM's error
    # finish can carry a message of its own
    "vllm.entrypoints.generate.base.serving:GenerateBaseServing": {
        "_raise_if_error": ["self", "finish_reason", "request_id"],
    },
}

# module-level functions the plugin calls -> the leading parameters it passes
FUNCTIONS: dict[str, list[str]] = {
    "vllm._custom_ops:cpu_attn_reshape_and_cache": [
        "key",
        "value",
        "key_cache",
        "value_cache",
        "slot_mapping",
        "isa",
    ],
    "vllm.distributed:get_tp_group": [],
    "vllm.model_executor.models.interfaces:supports_eagle3": ["model"],
}

# attributes the plugin reads off the tensor-parallel group (set in GroupCoordinator.__init__)
GROUP_ATTRS = ("rank_in_group", "world_size", "cpu_group")  # cpu_group: the ranks' agreements

# class -> attributes its __init__ sets that the plugin's front-end wrappers read: the engines'
# processors and core client (plugin._after_init, _replica_pool), the clients' engine list (one
# per data-parallel replica they manage), a front-end request's ids (metrics.Latest)
INIT_ATTRS: dict[str, tuple[str, ...]] = {
    "vllm.v1.engine.llm_engine:LLMEngine": ("input_processor", "output_processor", "engine_core"),
    "vllm.v1.engine.async_llm:AsyncLLM": ("input_processor", "output_processor", "engine_core"),
    "vllm.v1.engine.core_client:MPClient": ("core_engines",),
    "vllm.v1.engine.output_processor:RequestState": ("external_req_id", "parent_req", "request_id"),
    "vllm.v1.engine.output_processor:OutputProcessor": ("request_states",),  # a request's front-end state
    "vllm.distributed.parallel_state:GroupCoordinator": GROUP_ATTRS,
    "vllm.v1.worker.gpu_worker:Worker": ("use_v2_model_runner",),  # the CPU worker's base: V2 refused
    # the scheduler's hybrid admission (scheduler.EpiKVScheduler.epikv_window_need): each group's
    # manager, a sliding group's window, block size and each request's blocks
    "vllm.v1.core.kv_cache_manager:KVCacheManager": ("coordinator",),
    "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator": ("single_type_managers",),
    "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager": ("block_size", "req_to_blocks"),
    "vllm.v1.core.single_type_kv_cache_manager:SlidingWindowManager": ("sliding_window",),
}

# dataclass / struct -> the fields the plugin reads or writes
FIELDS: dict[str, set[str]] = {
    "vllm.v1.core.sched.output:SchedulerOutput": {
        "preempted_req_ids",
        "finished_req_ids",
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "num_scheduled_tokens",
    },
    "vllm.v1.core.sched.output:CachedRequestData": {"resumed_req_ids"},
    "vllm.v1.core.sched.output:NewRequestData": {
        "req_id",
        "prompt_token_ids",
        "sampling_params",
        "num_computed_tokens",
    },
    "vllm.v1.engine:EngineCoreOutput": {"request_id", "finish_reason", "kv_transfer_params"},
    "vllm.v1.engine:EngineCoreOutputs": {"outputs"},
    "vllm.v1.worker.gpu_model_runner:ExecuteModelState": {"aux_hidden_states"},
    "vllm.config.cache:CacheConfig": {"num_gpu_blocks", "block_size", "cache_dtype", "enable_prefix_caching"},
    # the engine's configuration as the plugin reads it (plugin.register's classes, start-up refusals)
    "vllm.config.vllm:VllmConfig": {
        "model_config",
        "cache_config",
        "parallel_config",
        "scheduler_config",
        "speculative_config",
        "additional_config",
    },
    "vllm.config.parallel:ParallelConfig": {"worker_cls", "tensor_parallel_size", "pipeline_parallel_size"},
    "vllm.config.model:ModelConfig": {
        "hf_config",
        "hf_text_config",
        "max_model_len",
        "model",
        "served_model_name",
    },
    "vllm.v1.attention.backend:CommonAttentionMetadata": {"seq_lens"},  # made physical per group
    # the runner finds the evicting group and wraps its builders; the scheduler sizes the pool
    "vllm.v1.kv_cache_interface:KVCacheConfig": {"num_blocks", "kv_cache_groups"},
    "vllm.v1.kv_cache_interface:KVCacheGroupSpec": {"layer_names", "kv_cache_spec"},
    "vllm.v1.worker.utils:AttentionGroup": {"metadata_builders"},
    "vllm.v1.worker.gpu_input_batch:CachedRequestState": {"block_ids"},  # a request's blocks to compact
    "vllm.v1.core.kv_cache_utils:KVCacheBlock": {"is_null"},  # a sliding block behind the window
    "vllm.config:SchedulerConfig": {"max_num_batched_tokens", "scheduler_cls"},  # first chunk; class
}

# attributes of live objects (checked on a running engine): the runner, its input batch, the
# input batch's first block table, a scheduler request, and the scheduler
RUNNER_ATTRS = (
    "seq_lens",
    "positions",
    "query_start_loc",
    "req_indices",
    "use_aux_hidden_state_outputs",
    "execute_model_state",
    "input_batch",
    "requests",
    "compilation_config",
    "model",
    "model_config",
    "attn_groups",
)
INPUT_BATCH_ATTRS = ("num_reqs", "req_ids", "num_computed_tokens_cpu", "num_prompt_tokens", "block_table")
BLOCK_TABLE_ATTRS = ("num_blocks_per_row", "slot_mapping")
REQUEST_ATTRS = (
    "request_id",
    "resumable",
    "prompt_token_ids",
    "num_prompt_tokens",
    "max_tokens",
    "sampling_params",
    "client_index",
    "status",
)
SCHEDULER_ATTRS = ("requests", "running", "kv_cache_manager")
