"""``--rank-every`` on the commands that take ``--interval`` (issue 56): refused in one line before a
model loads when it is not a step count or meets an interval other than 1, and saved in the report."""

from __future__ import annotations

import json

import pytest

from epikv.cli import main
from epikv.serve.ray_serve import ReplicaSettings


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rank-every", "0"], "rank_every must be a positive number of decode steps, got '0'"),
        (["--rank-every", "often"], "got 'often'"),
        (["--rank-every", "8", "--interval", "4"], "needs interval 1, got interval=4 with rank_every=8"),
        (["--rank-every", "8", "--param", "interval=2"], "got interval=2"),
    ],
)
@pytest.mark.parametrize("command", [["generate", "hello"], ["serve"]])
def test_a_bad_rank_every_is_one_line_before_the_model_loads(capsys, command, extra, message):
    assert main([*command, "--model", "/nonexistent/model", "--policy", "keydiff", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "nonexistent" not in err


def test_ray_replicas_check_rank_every_too():
    settings = ReplicaSettings(policy="keydiff", budget="64", interval=4, rank_every="8")
    with pytest.raises(ValueError, match="needs interval 1"):
        settings.budget_tokens()


def test_generate_reports_rank_every_and_holds_k_plus_one(capsys):
    argv = ["generate", "--json", "--policy", "keydiff", "--budget", "40", "--rank-every", "8"]
    assert main([*argv, "--max-new-tokens", "60", "--ignore-eos", "Say hi."]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["rank_every"], report["interval"]) == (8, 1)
    assert report["peak_cache_tokens"] == report["budget"] + 1 and report["evictions"] > 0
