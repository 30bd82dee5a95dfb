"""Occlusion labels on a constructed case, and the model scorer's prefix cache against no cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from epikv.calibrate.occlusion import FunctionScorer, Labeller, LabelSettings, combine, filler_ids, windows
from epikv.calibrate.scorer import ModelScorer
from epikv.calibrate.traces import Trace

# A toy vocabulary: ids 0..9 are the digits, 10 is end-of-sequence, 11.. are filler words.
EOS, CRITICAL, VOCAB = 10, 16, 20


def decode(ids: list[int]) -> str:
    return "".join(str(i) if i < 10 else " " for i in ids if i != EOS)


def toy_logprobs(ids: list[int]) -> np.ndarray:
    """Answers '5' then stops when the critical token is in the context, else answers '9'."""
    logits = np.zeros(VOCAB)
    if ids[-1] in (5, 9):
        logits[EOS] = 5.0
    else:
        logits[5 if CRITICAL in ids else 9] = 5.0
        logits[5] += 1.0  # '5' stays more likely than uniform either way: a graded log-likelihood
    return logits - np.log(np.exp(logits).sum())


def toy_trace(critical_at: int) -> Trace:
    prompt, span = [12, 13], [11] * 20
    span[critical_at - 2] = CRITICAL
    return Trace("toy", prompt, [*span, 5], True, 22, "tail", "5")


def labeller(kind: str, scorer=None, answer_tokens: int = 8) -> Labeller:
    settings = LabelSettings(kind=kind, window=4, stride=2, answer_tokens=answer_tokens)
    return Labeller(scorer or FunctionScorer(toy_logprobs), settings, decode, [EOS], EOS, VOCAB)


def test_windows_cover_the_span():
    assert windows(10, 20, 4, 2) == [(10, 14), (12, 16), (14, 18), (16, 20)]
    assert windows(10, 21, 4, 4) == [(10, 14), (14, 18), (17, 21)]
    assert windows(10, 12, 4, 2) == [(10, 12)]
    assert windows(10, 10, 4, 2) == []
    with pytest.raises(ValueError, match="stride"):
        windows(0, 10, 4, 0)


def test_fillers():
    assert filler_ids("eos", 3, EOS, 0, VOCAB, 0) == [EOS] * 3
    assert filler_ids("pad", 2, EOS, 7, VOCAB, 0) == [7, 7]
    drawn = filler_ids("random", 50, EOS, 0, VOCAB, 1)
    assert drawn == filler_ids("random", 50, EOS, 0, VOCAB, 1) and len(set(drawn)) > 1
    with pytest.raises(ValueError, match="filler"):
        filler_ids("zero", 1, EOS, 0, VOCAB, 0)


def test_combine_or_and_max():
    spans = [(0, 4), (2, 6), (4, 8)]
    assert combine(spans, np.array([0.0, 1.0, 0.0]), 0, 8, "or").tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert combine(spans, np.array([0.5, -1.0, 2.0]), 0, 8, "max").tolist() == [0.5] * 4 + [2.0] * 4


def test_occluding_the_critical_token_flips_the_answer():
    trace = toy_trace(critical_at=9)  # windows [8,12) and [6,10) cover position 9
    labels = labeller("flip").label(trace)
    assert labels.reference == "5"
    covering = [(lo, hi) for lo, hi in labels.windows if lo <= 9 < hi]
    assert covering == [(6, 10), (8, 12)]
    assert [bool(f) for f in labels.window_flip] == [(lo, hi) in covering for lo, hi in labels.windows]
    assert labels.decoded == 2  # only windows whose teacher-forced argmax departs are decoded
    expected = np.zeros(20, dtype=bool)
    expected[6 - 2 : 12 - 2] = True
    assert labels.token_flip.tolist() == expected.tolist()


def test_loglik_drop_is_positive_only_where_the_answer_depends():
    labels = labeller("loglik").label(toy_trace(critical_at=15))
    assert labels.window_flip is None and labels.token_flip is None
    covers = np.array([lo <= 15 < hi for lo, hi in labels.windows])
    assert (labels.window_drop[covers] > 0.5).all()
    assert np.allclose(labels.window_drop[~covers], 0.0)
    expected = np.zeros(20, dtype=bool)
    expected[12 - 2 : 18 - 2] = True  # the union of the covering windows [12, 16) and [14, 18)
    assert (labels.token_drop > 0.5).tolist() == expected.tolist()


def test_no_flip_when_the_answer_does_not_depend_on_the_span():
    blind = FunctionScorer(lambda ids: toy_logprobs([*ids[:-1], CRITICAL, ids[-1]]))
    labels = labeller("flip", blind).label(toy_trace(critical_at=9))
    assert not labels.window_flip.any() and labels.decoded == 0
    assert np.allclose(labels.window_drop, 0.0)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="label"):
        LabelSettings(kind="kl")
    with pytest.raises(ValueError, match="answer_tokens"):
        LabelSettings(answer_tokens=0)


def _reference_scorer(model: torch.nn.Module) -> FunctionScorer:
    @torch.no_grad()
    def next_logprobs(ids: list[int]) -> np.ndarray:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        return torch.log_softmax(logits, -1).numpy()

    return FunctionScorer(next_logprobs)


def test_prefix_cache_scorer_equals_recomputing(tiny_model):
    rng = np.random.default_rng(0)
    context = rng.integers(2, 97, 30).tolist()
    answer = rng.integers(2, 97, 6).tolist()
    occluded = [*context[:12], *[1] * 8, *context[20:]]
    fast, slow = ModelScorer(tiny_model), _reference_scorer(tiny_model)
    fast.prepare(context)
    for ctx, unchanged in ((context, len(context)), (occluded, 12), (occluded, 0)):
        logp, best = fast.teacher_force(ctx, answer, unchanged)
        ref_logp, ref_best = slow.teacher_force(ctx, answer, unchanged)
        np.testing.assert_allclose(logp, ref_logp, atol=1e-4)
        assert best.tolist() == ref_best.tolist()
        assert fast.greedy(ctx, 5, [1], unchanged) == slow.greedy(ctx, 5, [1], unchanged)
    # the clean cache must not have been extended by the calls above
    assert fast._clean.layers[0].keys.shape[-2] == len(context)
    assert fast._clean.held == [len(context)]
