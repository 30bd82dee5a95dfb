"""``rank_every`` (rho, issue 56) in the plugin's worker step, without vLLM: plain step batches over a
synthetic paged pool (each token's keys and values drawn from its request and position). At every
step each request's held positions, in every layer group and head, must be what the rule keeps:
a ranking (the policy's scores, recorded as the policy gave them, kept by ``CacheSpec.select``) every
rho steps or when no ranked candidate is left, and in between the lowest-ranked token still present
outside the protected tokens, the older on a tie, never a token newer than the ranking. rho = 1 is
tau = 1 exactly; the cache never holds more than K + 1 tokens; no prompt slot is ever written."""

from __future__ import annotations

import functools
import itertools
import pickle
import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from epikv.policies.base import ModelInfo
from epikv.policies.registry import policy_class
from epikv.vllm.compaction import SlotStore
from epikv.vllm.config import EpiKVSettings, Refused
from epikv.vllm.paged import PagedKV, PageLayout
from epikv.vllm.step import EpiKVWorkerState, NewRequest, StepBatch

MODEL = ModelInfo("m", 2, 4, 2, 16, 64)
B, K, STEPS, BLOCKS = 4, 16, 40, 8  # 32 slots per request >= K + 1
PROMPTS = {"a": 5, "b": 8, "c": 9}  # distinct lengths: a recorded score call finds its row by them
RECENT = {"recent": 2}  # a window shorter than rho: unranked tokens leave it before the next ranking


def settings_for(policy: str, rank_every: int | None) -> EpiKVSettings:
    interval = 1 if rank_every is None else None
    return EpiKVSettings(policy, K, interval, dict(RECENT), rank_every=rank_every)


def kv(request: str, position: int) -> torch.Tensor:
    seed = 1000 * list(PROMPTS).index(request) + position
    return torch.randn(
        MODEL.num_layers,
        MODEL.num_kv_heads,
        2 * MODEL.head_dim,
        generator=torch.Generator().manual_seed(seed),
    )


def run(
    policy: str,
    rank_every: int | None,
    monkeypatch,
    extra: dict[str, dict[str, Any]] | None = None,
    settings: EpiKVSettings | None = None,
) -> dict[str, Any]:
    """Prefill every request (``extra``: a request's ``extra_args``), then STEPS decode steps, on
    ``settings`` (default: :func:`settings_for`). Per request: its held positions after every step,
    (G, H) tuples of sorted positions; every score call of it (seen, positions, scores); its last
    counters; every slot a move wrote (its physical index)."""
    monkeypatch.undo()  # the unwrapped policy and move, whatever an earlier run of the test wrapped
    settings = settings or settings_for(policy, rank_every)
    state = EpiKVWorkerState(settings, settings.spec(MODEL), MODEL)
    ids, h, d = list(PROMPTS), MODEL.num_kv_heads, MODEL.head_dim
    pages = torch.zeros(MODEL.num_layers, len(ids) * BLOCKS, h, B, 2 * d)
    half = torch.arange(B)[:, None] * d + torch.arange(d)
    paged = PagedKV(list(pages), PageLayout(half, B * d + half))
    state.store, state.block_size = SlotStore(paged, state.spec, MODEL, pages.shape[1] * B), B
    blocks = {r: list(range(i * BLOCKS, (i + 1) * BLOCKS)) for i, r in enumerate(ids)}
    out: dict[str, Any] = {r: {"held": [], "scores": [], "written": set()} for r in ids}
    by_prompt = {p: r for r, p in PROMPTS.items()}
    cls, score, move = policy_class(policy), policy_class(policy).score, PagedKV.move

    def recorded(self, pstate, view):
        scores = score(self, pstate, view)
        for i, p in enumerate(view.prompt_len.tolist()):
            n = int(view.valid[i].sum())
            positions = view.sorted_positions[:, i, :, :n]
            values = scores[:, i : i + 1, :, :n].expand(positions.shape[0], 1, positions.shape[1], n)[:, 0]
            out[by_prompt[p]]["scores"].append((int(view.seen[i]), positions.clone(), values.clone()))
        return scores

    def watched(self, src, dst, layers, heads):
        for slot in dst.tolist():
            r = ids[slot // (BLOCKS * B)]
            out[r]["written"].add(blocks[r].index(slot // B) * B + slot % B)
        move(self, src, dst, layers, heads)

    monkeypatch.setattr(cls, "score", recorded)
    monkeypatch.setattr(PagedKV, "move", watched)
    state.after_update([NewRequest(r, p, 0, STEPS + 1, (extra or {}).get(r)) for r, p in PROMPTS.items()])
    computed = dict.fromkeys(ids, 0)
    for _ in range(STEPS + 1):
        scheduled = np.array([PROMPTS[r] if computed[r] == 0 else 1 for r in ids])
        starts = np.concatenate([[0], np.cumsum(scheduled)])
        positions = torch.cat(
            [torch.arange(computed[r], computed[r] + int(n)) for r, n in zip(ids, scheduled, strict=True)]
        )
        batch = StepBatch(
            ids, np.array([computed[r] for r in ids]), np.array([PROMPTS[r] for r in ids]), scheduled,
            starts, np.full(len(ids), BLOCKS * B), positions, blocks=lambda r: blocks[r],
        )  # fmt: skip
        dropped, bad = state.physical(batch)
        assert not bad.any()
        slots = []
        for i, r in enumerate(ids):
            for pos in range(computed[r], computed[r] + int(scheduled[i])):
                p = pos - int(dropped[i])
                assert p <= K  # physical slots 0..K: never more than K + 1 tokens
                slot = blocks[r][p // B] * B + p % B
                pages[:, slot // B, :, slot % B] = kv(r, pos)
                slots.append(slot)
        batch.slots = torch.tensor(slots)
        state.after_forward(batch, None)
        report, faults = state.take()
        assert faults == {}
        for i, r in enumerate(ids):
            computed[r] += int(scheduled[i])
            n = computed[r] - state.requests.dropped[r]
            held = state.store.positions[:, :, [blocks[r][p // B] * B + p % B for p in range(n)]]
            out[r]["held"].append(tuple(tuple(sorted(x.tolist())) for x in held.flatten(0, 1)))
            out[r]["report"] = report[r]
    return out


def reference(spec, prompt: int, rho: int, calls: list) -> tuple[list, list[int]]:
    """The held sets after every step by the rule, fed the recorded score calls at the rankings it
    makes (their positions must be what it holds then), and the seen counts it ranked at."""
    g_h = calls[0][1].shape[:2]
    present = [[set(range(prompt)) for _ in range(g_h[1])] for _ in range(g_h[0])]
    rank: list[list[dict]] = [[{} for _ in range(g_h[1])] for _ in range(g_h[0])]
    recent, ranked_at, held_sets, ranked_seen, calls = spec.policy.recent_window(K), None, [], [], list(calls)
    first = prompt if spec.policy.protect_prompt else min(spec.policy.n_sink, prompt)
    for t in range(STEPS + 1):
        seen = prompt + t
        if t:
            for row in present:
                for s in row:
                    s.add(seen - 1)
        held = len(present[0][0])
        if held > max(K, prompt) or (t == 0 and held > K):
            free = [
                [
                    {p for p in s if first <= p < seen - recent and p in rk}
                    for s, rk in zip(ps, rks, strict=True)
                ]
                for ps, rks in zip(present, rank, strict=True)
            ]
            empty = not all(f for row in free for f in row)
            if ranked_at is None or t - ranked_at >= rho or empty:
                call_seen, positions, scores = calls.pop(0)
                assert call_seen == seen, (call_seen, seen)
                ranked_at, ranked_seen = t, [*ranked_seen, seen]
                sel = spec.select(
                    scores[:, None], positions[:, None], torch.tensor([prompt]), torch.tensor([seen]),
                    torch.ones(1, held, dtype=torch.bool), [K],
                )  # fmt: skip
                for g, row in enumerate(present):
                    for hh in range(len(row)):
                        assert sorted(row[hh]) == positions[g, hh].tolist()
                        rank[g][hh] = {
                            int(p): float(v) for p, v in zip(positions[g, hh], scores[g, hh], strict=True)
                        }
                        index = sel.index[min(g, sel.index.shape[0] - 1), 0, min(hh, sel.index.shape[2] - 1)]
                        row[hh] = {int(positions[g, hh, i]) for i in index[: int(sel.kept[0])]}
            else:
                for g, row in enumerate(present):
                    for hh, s in enumerate(row):
                        victim = min(free[g][hh], key=lambda p: (rank[g][hh][p], p))
                        s.discard(victim)
        held_sets.append(tuple(tuple(sorted(s)) for row in present for s in row))
    assert not calls
    return held_sets, ranked_seen


@pytest.mark.parametrize("policy", ["keydiff", "random"])  # one set per layer and head; one for all
@pytest.mark.parametrize("rho", [1, 4])
def test_each_step_keeps_what_the_rule_keeps(policy, rho, monkeypatch):
    got = run(policy, rho, monkeypatch)
    spec = settings_for(policy, rho).spec(MODEL)
    for r, prompt in PROMPTS.items():
        want, ranked_seen = reference(spec, prompt, rho, got[r]["scores"])
        assert got[r]["held"] == want, r
        assert got[r]["report"].peak_cache_tokens == K + 1 and len(want[-1][0]) == K
        due = prompt + STEPS - K  # one eviction a step from seen = K + 1 on
        assert len(ranked_seen) == due if rho == 1 else -(-due // rho) <= len(ranked_seen) < due
        prompt_slots = prompt if spec.policy.protect_prompt else min(prompt, spec.policy.n_sink)
        assert min(got[r]["written"]) >= prompt_slots  # a protected (shareable) slot is never written


@pytest.mark.parametrize("policy", ["keydiff", "random"])
def test_rho_one_is_tau_one(policy, monkeypatch):
    want = run(policy, None, monkeypatch)
    got = run(policy, 1, monkeypatch)
    for r in PROMPTS:
        assert got[r]["held"] == want[r]["held"] and got[r]["report"] == want[r]["report"], r
        assert [(s, p.tolist()) for s, p, _ in got[r]["scores"]] == [
            (s, p.tolist()) for s, p, _ in want[r]["scores"]
        ]


def test_a_row_with_no_ranked_candidate_left_scores_again(monkeypatch):
    """rho = 100 never comes in 40 steps: every re-score is the rule's "nothing ranked is left"
    (random protects the prompt: after K + 1 - P - recent in-place steps, each new token unranked)."""
    got = run("random", 100, monkeypatch)
    spec = settings_for("random", 100).spec(MODEL)
    for r, prompt in PROMPTS.items():
        want, ranked_seen = reference(spec, prompt, 100, got[r]["scores"])
        assert got[r]["held"] == want
        assert len(ranked_seen) > 2  # the first ranking, then re-scores with nothing left to evict
        gaps = {b - a for a, b in itertools.pairwise(ranked_seen)}
        assert gaps == {K + 1 - prompt}, (r, ranked_seen)  # new tokens never left before a ranking


@pytest.mark.parametrize(
    ("extra", "line"),
    [({"rank_every": 0}, "got 0"), ({"rank_every": 4, "interval": 128}, "interval=128 with rank_every=4")],
)
def test_bad_rank_every_is_refused_in_one_line(extra, line):
    settings = EpiKVSettings.from_config({"epikv": {"policy": "keydiff", "budget": 64, **extra}})
    with pytest.raises(Refused, match=re.escape(line)) as err:
        settings.spec(MODEL)
    assert "\n" not in str(err.value) and "rank_every" in str(err.value)


def test_rank_every_round_trips_through_the_config():
    settings = EpiKVSettings.from_config({"epikv": {"policy": "keydiff", "budget": 64, "rank_every": 8}})
    assert settings.rank_every == 8 and settings.as_config()["rank_every"] == 8
    spec = settings.spec(MODEL)
    assert (spec.rank_every, spec.interval, spec.cap_tokens(10), spec.peak_tokens(10, 500)) == (8, 1, 65, 65)


# -- tensor parallelism: two ranks (one KV head each) hold what one process holds --------------------
def ranking_rank_main(rank: int, port: int, policy: str, fault: str, out: str) -> None:
    """``test_step_tp``'s rank under ``rank_every`` = 4 (its driver's settings, with rho added)."""
    from tests.plugin_without_vllm import test_step_faults, test_step_tp

    test_step_faults.EpiKVSettings = functools.partial(EpiKVSettings, rank_every=4)
    test_step_tp.rank_main(rank, port, policy, fault, out)


@pytest.mark.parametrize(("fault", "failed"), [("none", []), ("move", ["b"])])
def test_two_ranks_evict_the_same_tokens_in_place(tmp_path, monkeypatch, fault, failed):
    """keydiff (one set per layer and head) at rho = 4: each rank moves its own head's tokens, both
    pick the same victims from the first rank's ranking; a move that fails on rank 1 alone (b's
    slots) fails b on both ranks, and the others hold what one process holds."""
    from tests.plugin_without_vllm import test_step_faults, test_step_tp

    monkeypatch.setattr(test_step_faults, "EpiKVSettings", functools.partial(EpiKVSettings, rank_every=4))
    ref = test_step_faults.run("keydiff", tmp_path / "ref.jsonl")
    assert ref["faults"] == {} and all(ref["report"][r][1] > 0 for r in test_step_faults.PROMPTS)
    (tmp_path / "tp").mkdir()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    port = test_step_tp.free_port()
    mp.spawn(ranking_rank_main, args=(port, "keydiff", fault, str(tmp_path / "tp")), nprocs=2, join=True)
    for rank in range(2):
        got = pickle.loads((tmp_path / "tp" / f"rank{rank}.pkl").read_bytes())
        assert sorted(got["faults"]) == failed, rank
        live = [r for r in test_step_faults.PROMPTS if r not in failed]
        test_step_tp.same_as_reference(got, ref, rank, live)


def test_engine_kwargs_carry_rho_to_the_plugins_settings() -> None:
    """``epikv.vllm.engine_kwargs(..., rank_every=N)`` puts rho in the additional config, which the
    plugin's settings read back into its spec (not a policy parameter)."""
    import epikv.vllm

    config = epikv.vllm.engine_kwargs("keydiff", 64, rank_every=4)["additional_config"]
    assert config["epikv"] == {"policy": "keydiff", "budget": 64, "rank_every": 4}
    assert "rank_every" not in epikv.vllm.engine_kwargs("keydiff", 64)["additional_config"]["epikv"]
    assert epikv.vllm.EpiKVSettings.from_config(config).rank_every == 4
