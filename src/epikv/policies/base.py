"""What a policy is: a frozen dataclass of its paper's hyperparameters plus three small calls.

A policy never touches the model or the cache internals. It declares what it needs
(:class:`Needs`), turns each step's signals into per-token values the cache stores beside the keys
(:meth:`Policy.observe`), and scores the cached slots when the cache decides to compact
(:meth:`Policy.score`). The run spec (:class:`epikv.spec.CacheSpec`) carries the budget and the
interval; the cache applies them, keeps true positions and calls the one keep rule
(``CacheSpec.select``); the integration module supplies the signals.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

GRANULARITIES = ("global", "head", "layer", "layer_head")
FIRST_COMPACTIONS = ("after_prefill", "after_interval")


@dataclass(frozen=True)
class Needs:
    """Signals a policy asks the integration layer for.

    hidden_layers: decoder layers whose output hidden states (new tokens only) reach ``observe``.
    query_layer: layer whose attention projections recompute recent queries (Seg-Q), if any.
    attention_layers: layers whose attention rows of the new tokens reach ``observe`` (baselines);
    ``attention_queries`` how many recent query rows per layer are kept for ``score``.
    """

    hidden_layers: tuple[int, ...] = ()
    query_layer: int | None = None
    attention_layers: tuple[int, ...] = ()
    attention_queries: int = 0


@dataclass(frozen=True)
class ModelInfo:
    """What a policy may know of the model: its identity and shape, never its modules."""

    identity: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    context_length: int | None = None  # positions the model was trained on (max_position_embeddings)
    # layers with a sliding window of ``window`` tokens: they keep their own window, never evict
    sliding_layers: tuple[int, ...] = ()
    window: int | None = None

    @classmethod
    def from_config(cls, config: Any, identity: str) -> ModelInfo:
        """What a policy may know of a model, from its transformers text config: the one builder of
        epikv's engine (transformers' config), the vLLM plugin (vLLM's ``hf_text_config``, the same
        object) and the eval's vLLM client."""
        from epikv.archs import sliding_layers

        heads = config.num_attention_heads
        sliding, window = sliding_layers(config)
        return cls(
            identity=identity,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            hidden_size=config.hidden_size,
            context_length=getattr(config, "max_position_embeddings", None),
            sliding_layers=sliding,
            window=window,
        )

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """The layers whose cache a policy scores and evicts (every layer but the sliding ones)."""
        return tuple(i for i in range(self.num_layers) if i not in self.sliding_layers)

    @property
    def window_slots(self) -> int:
        """What a row's sliding-window rings (W+1 slots in each sliding layer) cost, in slots of the
        evicting layers (the unit of a KV pool), rounded up; 0 without sliding layers."""
        if not self.sliding_layers or self.window is None:
            return 0
        return -(-(self.window + 1) * len(self.sliding_layers) // len(self.cache_layers))


@dataclass(frozen=True)
class Bands:
    """A model's EpiKV band layers as data (the cache spec looks the profile up; policies never read
    files). ``origin`` says where they came from, for logs and saved configs."""

    band_a: int
    band_b: int
    origin: str = ""


@dataclass
class StepSignals:
    """One forward pass seen by a policy.

    hidden: layer -> (B, q, hidden) output states of the new tokens (at prefill only the last
    prompt position, (B, 1, hidden), real for every row under left padding); valid: (B, q) bool (False on
    left padding); positions: (B, q) true positions; prefill: a pass of the prompt (the first pass
    of the generation, or a later chunk of a long prompt, which comes in several passes);
    attention: layer -> (B, Hq, w, L) attention rows of the last w = ``Needs.attention_queries`` new
    tokens over the cache after the update; attention_colsum: layer -> (B, Hq, L) the rows of all new
    tokens summed (only for policies that declare attention layers); buffers: the cache's stored
    per-token values before this step (name -> (G, B, H, L_old)); slots_valid: (B, L) the cache's
    real slots after this step's update (False at holes: left padding, rows of other lengths);
    write_slots: (B, q) the slot each new token was written to (a row's tokens fill its slots from
    the front, so a shorter row's new token sits inside L_old, not at the end), or (G, B, H) per layer
    group and KV head when a row wrote into the slot it freed in place (``rank_every``).
    """

    hidden: dict[int, torch.Tensor]
    valid: torch.Tensor
    positions: torch.Tensor
    prefill: bool
    attention: dict[int, torch.Tensor] = field(default_factory=dict)
    attention_colsum: dict[int, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    slots_valid: torch.Tensor | None = None
    write_slots: torch.Tensor | None = None


class CacheView(Protocol):
    """Read-only view of the cache handed to :meth:`Policy.score`."""

    budget: int
    num_layers: int
    layers: tuple[int, ...]  # the layers that evict (all but sliding-window layers), in order
    prompt_len: torch.Tensor  # (B,)
    seen: torch.Tensor  # (B,)
    valid: torch.Tensor  # (B, L)
    buffers: dict[str, torch.Tensor]  # name -> (G, B, H, L)

    def keys(self, layer: int) -> torch.Tensor: ...  # (B, H, L, D), post-RoPE
    def values(self, layer: int) -> torch.Tensor: ...  # (B, H, L, D)
    # (B, H, L): each key's variance over D (``scoring.slot_variance``), read in bounded pieces
    def key_variance(self, layer: int) -> torch.Tensor: ...
    # (B, H, L); -1 at holes; layer None: the first of ``layers``
    def positions(self, layer: int | None = None) -> torch.Tensor: ...
    def project_queries(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


S = TypeVar("S")


@dataclass(frozen=True)
class Policy(Generic[S]):
    """Base of every policy. Subclasses are frozen dataclasses whose fields are the hyperparameters;
    ``S`` is the type of its per-generation state (a :class:`~epikv.policies.rows.RowState`, or None).

    interval: compaction interval tau in decode steps (1 = every step).
    recent: protected recent window; None = the method's default (see :meth:`recent_window`).
    protect_prompt: keep every prompt token; n_sink: keep the first n_sink positions.
    first_compaction: when a row's tau counter starts. ``after_prefill``: it starts full, so a row
    over K compacts right after its prefill; ``after_interval``: it starts at 0 after the prefill,
    so the first compaction waits tau decode steps (the EpiKV authors' harness).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    source: ClassVar[str] = ""
    granularity: ClassVar[str] = "global"
    evicts: ClassVar[bool] = True
    # What the policy reads, for listings made without a model ("hidden_states", "recent_queries",
    # "attention_weights"); ``needs()`` gives the exact layers once resolved.
    requires: ClassVar[tuple[str, ...]] = ()
    # Whether ``resolve`` reads EpiKV band layers (the spec then looks up the model's profile).
    uses_bands: ClassVar[bool] = False
    # Whether the policy ranks by attention rows (derived from ``requires``: vLLM never makes them)
    reads_attention: ClassVar[bool] = False

    interval: int = 1
    recent: int | None = None
    protect_prompt: bool = True
    n_sink: int = 0
    first_compaction: str = "after_prefill"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.reads_attention = "attention_weights" in cls.requires

    def __post_init__(self) -> None:
        if self.first_compaction not in FIRST_COMPACTIONS:
            raise ValueError(
                f"{self.name}: first_compaction must be one of {FIRST_COMPACTIONS}, "
                f"got {self.first_compaction!r}"
            )
        if self.interval < 1:
            raise ValueError(f"{self.name}: interval must be >= 1, got {self.interval}")
        if self.recent is not None and self.recent < 0:
            raise ValueError(f"{self.name}: recent must be >= 0 or None, got {self.recent}")
        if self.n_sink < 0:
            raise ValueError(f"{self.name}: n_sink must be >= 0, got {self.n_sink}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"{self.name}: unknown granularity {self.granularity!r}")

    # -- configuration -------------------------------------------------------------------------
    def needs(self) -> Needs:
        return Needs()

    def resolve(self, model: ModelInfo, bands: Bands | None = None) -> Policy[S]:
        """Fill model-dependent defaults (bands, given as data) and check them against the model."""
        return self

    def recent_window(self, budget: int) -> int:
        """Protected recent tokens at budget K: the paper's r = min(128, floor(K/4)) unless set."""
        return self.recent if self.recent is not None else min(128, budget // 4)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, **asdict(self)}

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """Name, summary, source, defaults and requirements, for ``epikv policies``."""
        defaults = {f.name: getattr(cls(), f.name) for f in fields(cls)}
        needs = {k: k in cls.requires for k in ("hidden_states", "recent_queries", "attention_weights")}
        return {
            "name": cls.name,
            "summary": cls.summary,
            "source": cls.source,
            "evicts": cls.evicts,
            "granularity": cls.granularity,
            "needs": needs,
            "defaults": defaults,
        }

    def with_params(self, **params: Any) -> Policy[S]:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"{self.name}: unknown parameter(s) {unknown}; known: {sorted(known)}")
        return replace(self, **params)

    # -- per generation ------------------------------------------------------------------------
    def init_state(self, batch_size: int, model: ModelInfo, device: torch.device) -> S:
        """Fresh per-row state for ``batch_size`` rows (None for a stateless policy)."""
        return None  # type: ignore[return-value]

    def observe(self, state: S, step: StepSignals) -> dict[str, torch.Tensor]:
        """Per-token values stored aligned with the slots, name -> (G, B, H, n).

        n = q (the new tokens only) appends to the stored buffer; n = L_old + q (every slot, as
        when accumulating attention) replaces it. Return every buffer at every step."""
        return {}

    def score(self, state: S, view: CacheView) -> torch.Tensor:
        """Scores of the cached slots, (G, B, H, L); +inf keeps, -inf drops; higher is kept first."""
        raise NotImplementedError(f"policy {self.name!r} does not score")  # pragma: no cover


def global_scores(x: torch.Tensor) -> torch.Tensor:
    """Lift (B, L) slot scores to the (1, B, 1, L) layout the selection function expects."""
    return x[None, :, None, :]
