"""The register of every vLLM name the plugin relies on, as data: one :class:`Pin` per name it
subclasses, overrides, wraps, replaces, calls or reads, with why and what would retire it, and the
vLLM versions it runs on (exactly).

``tests/vllm/test_contract.py`` checks every record against the installed vLLM (each name resolves,
each method keeps the leading parameters relied on, each field and attribute is still set), and
``tests/plugin_without_vllm/test_register.py`` fails when code under ``epikv/vllm`` touches a vLLM
name that has no record here. Imports nothing of vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

VLLM_VERSIONS = ("0.32.0",)
"""The vLLM releases the plugin runs on: the private runner and scheduler methods it overrides are
checked against these, and a patch release may move them."""

KINDS = ("subclass", "override", "wrap", "replace", "call", "read", "write")
CHECKS = ("exists", "params", "init", "field", "live", "source")


@dataclass(frozen=True)
class Pin:
    """One vLLM name: ``target`` is ``module:Qualname`` or ``module:Qualname.member``; ``kind`` how
    the plugin touches it (:data:`KINDS`); ``why`` and ``retire`` (what in vLLM would make it
    unnecessary). ``check`` is how the contract test checks it against the installed vLLM
    (:data:`CHECKS`): the name resolves; ``params`` are the callable's leading parameters; the owner's
    ``__init__`` sets it; a dataclass or struct field; read off a live engine (``test_traffic``); or
    ``source`` = (``module:Qualname`` of a function, text its source must hold)."""

    target: str
    kind: str
    why: str
    retire: str
    check: str = "exists"
    params: tuple[str, ...] = ()
    source: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.check not in CHECKS or ":" not in self.target:
            raise ValueError(f"pin {self.target!r}: kind {self.kind!r}, check {self.check!r}")

    @property
    def owner(self) -> str:
        """``module:Qualname`` of the class (or module object) holding the member, or the target."""
        module, qual = self.target.split(":")
        return f"{module}:{qual.rsplit('.', 1)[0]}" if "." in qual else self.target

    @property
    def member(self) -> str | None:
        qual = self.target.split(":")[1]
        return qual.rsplit(".", 1)[1] if "." in qual else None

    @property
    def dotted(self) -> str:
        return self.target.replace(":", ".")


def _each(
    owner: str, kind: str, members: Iterable[str], why: str, retire: str, check: str = "exists"
) -> list[Pin]:
    """One record per member of ``owner`` that shares a reason."""
    return [Pin(f"{owner}.{m}", kind, why, retire, check) for m in members]


def _method(target: str, kind: str, params: Iterable[str], why: str, retire: str) -> Pin:
    return Pin(target, kind, why, retire, "params", tuple(params))


RUNNER = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"
SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
MANAGER = "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager"
_NO_HOOK = "vLLM's runner gains a KV-eviction hook (a per-request compact step between forwards)"
_NO_CAP = "vLLM's scheduler takes a per-request token cap"
_FRONT = "vLLM validates extra_args through a plugin hook and carries a finish message"
_RUNNER_WHY = "the capped KV spec, the worker's books, physical slots before the forward, compaction after it"

PINS: tuple[Pin, ...] = (
    # -- the worker ---------------------------------------------------------------------------------
    Pin(RUNNER, "subclass", "EpiKVCPURunner: " + _RUNNER_WHY, _NO_HOOK),
    *[
        _method(f"{RUNNER}.{name}", "override", params, _RUNNER_WHY, _NO_HOOK)
        for name, params in {
            "__init__": ["self", "vllm_config", "device"],
            "_update_states": ["self", "scheduler_output"],
            "_prepare_inputs": ["self", "scheduler_output", "num_scheduled_tokens"],
            "execute_model": ["self", "scheduler_output", "intermediate_tensors"],
            "sample_tokens": ["self", "grammar_output"],
            "get_kv_cache_spec": ["self"],
            "initialize_kv_cache": ["self", "kv_cache_config"],
            "_get_eagle3_aux_layers_from_config": ["self"],
        }.items()
    ],
    *_each(
        RUNNER, "read",
        ("seq_lens", "positions", "query_start_loc", "req_indices", "execute_model_state", "input_batch",
         "requests", "compilation_config", "model", "model_config",
         "attn_groups"),
        "the runner's step state the worker reads (runner.EpiKVCPURunner)", _NO_HOOK, "live",
    ),
    Pin(f"{RUNNER}.use_aux_hidden_state_outputs", "write", "band layers' hidden states ride EAGLE-3's path",
        _NO_HOOK, "live"),
    Pin("vllm.v1.worker.cpu_worker:CPUWorker", "subclass", "EpiKVCPUWorker builds EpiKVCPURunner",
        "a runner-class option on vLLM's worker"),
    _method("vllm.v1.worker.cpu_worker:CPUWorker.init_device", "override", ["self"],
            "the worker builds its runner inline", "a runner-class option on vLLM's worker"),
    Pin("vllm.v1.worker.cpu_worker:CPUModelRunner", "replace",
        "swapped for EpiKVCPURunner during CPUWorker.init_device (mock.patch.object)",
        "a runner-class option on vLLM's worker", "source",
        source=("vllm.v1.worker.cpu_worker:CPUWorker.init_device", "CPUModelRunner(self.vllm_config")),
    Pin("vllm.v1.worker.cpu_worker:CPUWorker.use_v2_model_runner", "read", "the V2 runner is refused",
        "the plugin ports to the V2 runner", "init"),
    _method("vllm.v1.worker.block_table:BlockTable.compute_slot_mapping", "call",
            ["self", "num_reqs", "query_start_loc", "positions"],
            "slots from physical positions on the evicting group's table",
            "vLLM's block table takes per-row position offsets"),
    *_each("vllm.v1.worker.block_table:BlockTable", "read", ("num_blocks_per_row", "slot_mapping"),
           "each row's room and this step's slots (runner._step_batch)", _NO_HOOK, "live"),
    *_each("vllm.v1.worker.gpu_input_batch:InputBatch", "read",
           ("num_reqs", "req_ids", "num_computed_tokens_cpu", "num_prompt_tokens", "block_table"),
           "the step's rows (runner._step_batch)", _NO_HOOK, "live"),
    Pin("vllm.v1.worker.gpu_input_batch:CachedRequestState.block_ids", "read", "a request's blocks",
        _NO_HOOK, "field"),
    _method("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.build", "wrap",
            ["self", "common_prefix_len", "common_attn_metadata"],
            "the evicting group's attention lengths are physical (a drift is silently wrong attention)",
            "vLLM's attention metadata takes per-group sequence lengths"),
    Pin("vllm.v1.attention.backend:CommonAttentionMetadata.seq_lens", "write",
        "copied and made physical per group (runner._physical_lengths)", _NO_HOOK, "field"),
    Pin("vllm.v1.worker.utils:AttentionGroup.metadata_builders", "read", "the builders wrapped per group",
        _NO_HOOK, "field"),
    Pin("vllm.model_executor.layers.attention.attention:Attention.kv_cache", "read",
        "each evicting layer's pages (runner._attention_layers)", _NO_HOOK, "init"),
    Pin("vllm.model_executor.layers.attention.attention:Attention.isa", "read",
        "the CPU backend's writer ISA, for the page-layout probe", _NO_HOOK, "source",
        source=("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder._set_isa_to_layers",
                "layer.isa = ")),
    Pin("vllm.v1.worker.gpu_model_runner:ExecuteModelState.aux_hidden_states", "read",
        "the band layers' hidden states after the forward", _NO_HOOK, "field"),
    Pin("vllm.v1.outputs:ModelRunnerOutput.req_ids", "read", "counters ride a real step's output",
        _NO_HOOK, "field"),
    Pin("vllm.v1.outputs:EMPTY_MODEL_RUNNER_OUTPUT", "read", "no counters on the shared empty output",
        _NO_HOOK),
    _method("vllm._custom_ops:cpu_attn_reshape_and_cache", "call",
            ["key", "value", "key_cache", "value_cache", "slot_mapping", "isa"],
            "the backend's own writer probes the page layout", "never: the layout is the backend's"),
    *_each("vllm.v1.kv_cache_interface:KVCacheConfig", "read", ("num_blocks", "kv_cache_groups"),
           "the evicting group and the pool's size", _NO_CAP, "field"),
    *_each("vllm.v1.kv_cache_interface:KVCacheGroupSpec", "read", ("layer_names", "kv_cache_spec"),
           "which group evicts", _NO_CAP, "field"),
    Pin("vllm.v1.kv_cache_interface:SlidingWindowSpec", "read", "a hybrid's sliding layers keep vLLM's spec",
        _NO_CAP),
    Pin("vllm.v1.kv_cache_interface:SlidingWindowSpec.sliding_window", "read", "the window as configured",
        _NO_CAP, "field"),
    # -- the KV spec and the scheduler ---------------------------------------------------------------
    Pin("vllm.v1.kv_cache_interface:FullAttentionSpec", "subclass",
        "EpiKVAttentionSpec: the cap, and what one request holds at start-up", _NO_CAP),
    _method("vllm.v1.kv_cache_interface:FullAttentionSpec.merge", "override", ["specs"],
            "layers of one group agree on the cap", _NO_CAP),
    _method("vllm.v1.kv_cache_interface:FullAttentionSpec.max_memory_usage_bytes", "override",
            ["self", "vllm_config"], "start-up's check and auto-fit see the policy's longest request",
            _NO_CAP),
    *_each("vllm.v1.kv_cache_interface:FullAttentionSpec", "read", ("block_size",), "blocks of a request",
           _NO_CAP, "field"),
    Pin("vllm.v1.kv_cache_interface:FullAttentionSpec.page_size_bytes", "read", "bytes of a block", _NO_CAP),
    _method("vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry._ensure_registered", "call", ["vllm_config"],
            "vLLM's own entries first, so ours is not overwritten", "a public registration hook"),
    _method("vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry.register", "call",
            ["kvcache_spec_cls", "manager_class", "uniform_type_base_spec"],
            "the capped spec's manager beside full attention", _NO_CAP),
    Pin(SCHEDULER, "subclass", "EpiKVScheduler: admission by reservation, plans, faults, counters", _NO_CAP),
    *[
        _method(f"{SCHEDULER}.{name}", "override", params, "admission, plans, faults failing alone", _NO_CAP)
        for name, params in {
            "__init__": ["self", "vllm_config", "kv_cache_config"],
            "add_request": ["self", "request"],
            "update_from_output": ["self", "scheduler_output", "model_runner_output"],
            "_preempt_request": ["self", "request", "timestamp", "drop_stale_output"],
            "_free_request": ["self", "request", "delay_free_blocks"],
            "finish_requests": ["self", "request_ids", "finished_status"],
        }.items()
    ],
    Pin(f"{SCHEDULER}.max_model_len", "read", "the clamp of a reservation", _NO_CAP, "init"),
    *_each(SCHEDULER, "read", ("requests", "running", "kv_cache_manager"), "its requests and pool",
           _NO_CAP, "live"),
    Pin(MANAGER, "subclass", "EpiKVAttentionManager: a request's whole reservation at its first allocation",
        _NO_CAP),
    *[
        _method(f"{MANAGER}.{name}", "override", params, "all reserved blocks at once; prompt blocks cached",
                _NO_CAP)
        for name, params in {
            "get_num_blocks_to_allocate": ["self", "request_id", "num_tokens"],
            "allocate_new_blocks": ["self", "request_id", "num_tokens", "num_tokens_main_model"],
            "cache_blocks": ["self", "request", "num_tokens"],
        }.items()
    ],
    # called with seven positional arguments and two keywords (scheduler.epikv_alone_blocks)
    _method("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.get_num_blocks_to_allocate", "call",
            ["self", "request_id", "num_tokens", "new_computed_blocks", "num_encoder_tokens",
             "total_computed_tokens", "num_local_computed_tokens", "num_tokens_main_model",
             "apply_admission_cap", "prefill_end"],
            "a request's blocks on an empty pool, every group, by vLLM's own count", _NO_CAP),
    Pin("vllm.v1.core.kv_cache_manager:KVCacheManager.coordinator", "read", "each group's manager", _NO_CAP,
        "init"),
    Pin("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.single_type_managers", "read",
        "each group's manager", _NO_CAP, "init"),
    *[
        Pin(f"vllm.v1.core.single_type_kv_cache_manager:{cls}.{name}", "read", "a group's blocks per request",
            _NO_CAP, "init")
        for cls in ("FullAttentionManager", "SlidingWindowManager")
        for name in ("block_size", "req_to_blocks")
    ],
    Pin("vllm.v1.core.single_type_kv_cache_manager:SlidingWindowManager", "read", "a hybrid's sliding groups",
        _NO_CAP),
    Pin("vllm.v1.core.single_type_kv_cache_manager:SlidingWindowManager.sliding_window", "read",
        "a sliding group's window", _NO_CAP, "init"),
    Pin("vllm.v1.core.kv_cache_utils:KVCacheBlock.is_null", "read", "a sliding block behind the window",
        _NO_CAP, "field"),
    *_each("vllm.v1.request:Request", "read",
           ("request_id", "resumable", "prompt_token_ids", "num_prompt_tokens", "max_tokens",
            "sampling_params",
            "client_index", "status"), "a request's plan and failure", _NO_CAP, "live"),
    Pin("vllm.v1.request:RequestStatus.FINISHED_ERROR", "write", "a failed request's status", _NO_CAP),
    Pin("vllm.v1.engine:FinishReason.ERROR", "write", "a failed request's finish", _NO_CAP),
    *_each("vllm.v1.engine:EngineCoreOutput", "write", ("request_id", "finish_reason", "kv_transfer_params"),
           "counters and failures on the outputs", _FRONT, "field"),
    Pin("vllm.v1.engine:EngineCoreOutputs.outputs", "write", "failed requests' outputs", _FRONT, "field"),
    *_each("vllm.v1.core.sched.output:SchedulerOutput", "read",
           ("preempted_req_ids", "finished_req_ids", "scheduled_new_reqs", "scheduled_cached_reqs",
            "num_scheduled_tokens"), "the worker's request lifecycle", _NO_HOOK, "field"),
    Pin("vllm.v1.core.sched.output:CachedRequestData.resumed_req_ids", "read", "resumed requests", _NO_HOOK,
        "field"),
    *_each("vllm.v1.core.sched.output:NewRequestData", "read",
           ("req_id", "prompt_token_ids", "sampling_params", "num_computed_tokens"), "a new request's books",
           _NO_HOOK, "field"),
    *_each("vllm.sampling_params:SamplingParams", "read", ("max_tokens", "extra_args"),
           "a request's length and its epikv_budget", _FRONT, "field"),
    _method("vllm.utils.math_utils:cdiv", "call", ["a", "b"], "blocks of tokens, as vLLM counts them",
            "never: vLLM's own rounding"),
    # -- configuration and start-up -----------------------------------------------------------------
    _method("vllm.platforms:current_platform.check_and_update_config", "wrap", ["vllm_config"],
            "the platform patch: the plugin's worker and scheduler classes, then its start-up refusals",
            "vLLM selects worker and scheduler classes by plugin"),
    Pin("vllm.platforms:current_platform", "read", "the platform patched and checked", "never"),
    Pin("vllm.platforms:current_platform.is_cpu", "call", "only the CPU backend is built", "a GPU port"),
    Pin("vllm.platforms:current_platform.device_name", "read", "named in the refusal", "a GPU port"),
    Pin("vllm:__version__", "read", "the exact versions refused otherwise (VLLM_VERSIONS)", "never"),
    *_each("vllm.config.vllm:VllmConfig", "read",
           ("model_config", "cache_config", "parallel_config", "scheduler_config", "speculative_config",
            "additional_config", "lora_config", "kv_transfer_config"),
           "the engine's configuration (settings, start-up refusals)", "never", "field"),
    *_each("vllm.config.model:ModelConfig", "read",
           ("hf_config", "hf_text_config", "max_model_len", "model", "served_model_name", "quantization",
            "enable_prompt_embeds", "model_impl"),
           "the model and the refusals that depend on it", "never", "field"),
    Pin("vllm.config.model:ModelConfig.use_mla", "read", "latent attention is refused", "never"),
    Pin("vllm.config.model:ModelConfig.architectures", "read", "the model class (a property)", "never"),
    *_each("vllm.config.cache:CacheConfig", "read",
           ("num_gpu_blocks", "block_size", "cache_dtype", "enable_prefix_caching"), "the pool", "never",
           "field"),
    *_each("vllm.config.parallel:ParallelConfig", "read",
           ("worker_cls", "tensor_parallel_size", "pipeline_parallel_size"), "worker class, parallelism",
           "never", "field"),
    *_each("vllm.config:SchedulerConfig", "read",
           ("max_num_batched_tokens", "scheduler_cls", "async_scheduling"), "the first chunk; the class",
           "never", "field"),
    _method("vllm.utils.import_utils:resolve_obj_by_qualname", "call", ["qualname"],
            "a configured worker or scheduler class is the plugin's or a subclass", "never"),
    Pin("vllm.model_executor.models:ModelRegistry", "read", "the model class, for the aux-hidden-state check",
        "never"),
    _method("vllm.model_executor.models:ModelRegistry.resolve_model_cls", "call",
            ["architectures", "model_config"], "the model class, for the aux-hidden-state check",
            "never"),
    _method("vllm.model_executor.models.interfaces:supports_eagle3", "call", ["model"],
            "band layers need EAGLE-3's aux-hidden-state path", "a hidden-state tap in vLLM's runner"),
    # -- tensor parallelism ---------------------------------------------------------------------------
    _method("vllm.distributed:get_tp_group", "call", [], "this rank's group", "never"),
    *[
        _method(f"vllm.distributed.parallel_state:GroupCoordinator.{name}", "call", params,
                "heads gathered and scores shared across ranks", "never")
        for name, params in {"all_gather": ["self", "input_", "dim"],
                             "broadcast": ["self", "input_", "src"]}.items()
    ],
    *_each("vllm.distributed.parallel_state:GroupCoordinator", "read",
           ("rank_in_group", "world_size", "cpu_group"),
           "this rank, the ranks, and the group the agreements run on", "never", "init"),
    # -- the front end ----------------------------------------------------------------------------------
    _method("vllm.v1.engine.input_processor:InputProcessor.process_inputs", "wrap", ["self"],
            "the front end's 400s (plugin._wrap_inputs)", _FRONT),
    *[
        _method(f"vllm.v1.engine.output_processor:OutputProcessor.{name}", "wrap", params,
                "counters into metrics; failed requests' lines", _FRONT)
        for name, params in {
            "process_outputs": ["self", "engine_core_outputs"],
            "_update_stats_from_finished": ["self", "req_state", "finish_reason"],
            "abort_requests": ["self", "request_ids", "internal"],
        }.items()
    ],
    Pin("vllm.v1.engine.output_processor:OutputProcessor.request_states", "read", "front-end request state",
        _FRONT, "init"),
    *_each("vllm.v1.engine.output_processor:RequestState", "read",
           ("external_req_id", "parent_req", "request_id"),
           "a front-end request's ids (metrics.Latest)", _FRONT, "init"),
    *[
        _method(f"{owner}.__init__", "wrap", ["self", "vllm_config"],
                "each engine's processors get its counters and pool (plugin._after_init)", _FRONT)
        for owner in ("vllm.v1.engine.async_llm:AsyncLLM", "vllm.v1.engine.llm_engine:LLMEngine")
    ],
    *[
        Pin(f"{owner}.{name}", "read", "the engine's processors and core client", _FRONT, "init")
        for owner in ("vllm.v1.engine.async_llm:AsyncLLM", "vllm.v1.engine.llm_engine:LLMEngine")
        for name in ("input_processor", "output_processor", "engine_core")
    ],
    Pin("vllm.v1.engine.core_client:MPClient.core_engines", "read", "one pool per data-parallel replica",
        _FRONT, "init"),
    _method("vllm.v1.engine.async_llm:AsyncLLM.generate", "wrap", ["self", "prompt", "sampling_params"],
            "a refused request is a 400 before any stream starts (answers.wrap_generate)", _FRONT),
    _method("vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.create_chat_completion",
            "wrap", ["self", "request"], "a chat's prompt field is messages", _FRONT),
    _method("vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_stream_generator",
            "wrap", ["self", "request", "result_generator"], "the finishing chunk carries the counters",
            "vLLM streams kv_transfer_params itself"),
    _method("vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.completion_stream_generator",
            "wrap", ["self", "request", "engine_inputs", "result_generator"],
            "the finishing chunk carries the counters", "vLLM streams kv_transfer_params itself"),
    *[
        _method(f"vllm.entrypoints.generate.beam_search.{where}:{cls}.beam_search", "wrap", ["self"],
                "beam search refused per request (each beam step re-prefills)", "never")
        for where, cls in (("offline", "BeamSearchOfflineMixin"), ("online", "BeamSearchOnlineMixin"))
    ],
    Pin("vllm.exceptions:VLLMValidationError", "call", "refusals as vLLM's own 400s", "never"),
    Pin("vllm.exceptions:GenerationError", "call", "a failed request's 500 with the epikv line", _FRONT),
    # -- the eval client (eval_worker, in vLLM's environment) -------------------------------------------
    Pin("vllm:LLM", "call", "the eval's engine", "never"),
    Pin("vllm:SamplingParams", "call", "the eval's sampling", "never"),
    Pin("vllm.inputs:TokensPrompt", "call", "the eval's prompts as token ids", "never"),
)  # fmt: skip

NOT_VLLM = {
    # transformers' config attributes, read by name on vLLM's hf_config (the same object epikv reads)
    "num_key_value_heads": "transformers config",
    "head_dim": "transformers config",
    "max_position_embeddings": "transformers config",
    "num_hidden_layers": "transformers config",
    "alibi": "transformers config (ALiBi refusal)",
    "use_alibi": "transformers config (ALiBi refusal)",
    "position_embedding_type": "transformers config (ALiBi refusal)",
}
"""Names the plugin reads with ``getattr`` by a literal that are not vLLM's, with whose they are."""


def version_refusal(version: str) -> str | None:
    """The one-line refusal of a vLLM release the plugin is not pinned to (None: one of
    :data:`VLLM_VERSIONS`)."""
    if version in VLLM_VERSIONS:
        return None
    return (
        f"epikv: vLLM {version} is not supported; the plugin runs on vLLM {', '.join(VLLM_VERSIONS)} "
        "exactly (it overrides private methods of vLLM's runner and scheduler, pinned in epikv/vllm/pins.py)"
    )


def _by(check: str) -> list[Pin]:
    return [p for p in PINS if p.check == check]


def _members(check: str, owner: str) -> tuple[str, ...]:
    return tuple(str(p.member) for p in _by(check) if p.owner == owner)


# The views the contract and live-engine tests iterate (each derived from PINS, never written twice):
# methods -> leading parameters, functions -> leading parameters, attributes __init__ sets, fields, and
# attributes of live objects (the runner, its input batch and block table, a request, the scheduler)
METHODS: dict[str, dict[str, list[str]]] = {}
FUNCTIONS: dict[str, list[str]] = {}
for _p in _by("params"):
    if _p.member is None:
        FUNCTIONS[_p.target] = list(_p.params)
    else:
        METHODS.setdefault(_p.owner, {})[_p.member] = list(_p.params)
INIT_ATTRS: dict[str, tuple[str, ...]] = {p.owner: _members("init", p.owner) for p in _by("init")}
FIELDS: dict[str, set[str]] = {p.owner: set(_members("field", p.owner)) for p in _by("field")}
RUNNER_ATTRS = _members("live", RUNNER)
INPUT_BATCH_ATTRS = _members("live", "vllm.v1.worker.gpu_input_batch:InputBatch")
BLOCK_TABLE_ATTRS = _members("live", "vllm.v1.worker.block_table:BlockTable")
REQUEST_ATTRS = _members("live", "vllm.v1.request:Request")
SCHEDULER_ATTRS = _members("live", SCHEDULER)
GROUP_ATTRS = INIT_ATTRS["vllm.distributed.parallel_state:GroupCoordinator"]
