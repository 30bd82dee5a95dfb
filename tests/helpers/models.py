"""Tiny random-weight models (no network) and the policy parameters they need."""

from __future__ import annotations

import torch

from epikv.models.tiny import tiny_model as build_tiny_model

SERVE_MODEL_NAME = "tiny-serve"

# Bands for the 4-layer tiny models (Band A = 1, Band B = 2): every banded policy needs them.
TINY_BANDS = {"band_a": 1, "band_b": 2}


def make_tiny(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    """The library's tiny model (4 layers, sdpa, 4096 positions) named ``tiny-<arch>``."""
    return build_tiny_model(arch, seed, identity=f"tiny-{arch}")


def policy_params(name: str) -> dict:
    from epikv.policies import policy_class
    from epikv.policies.epiphany import BandedPolicy

    return dict(TINY_BANDS) if issubclass(policy_class(name), BandedPolicy) else {}
