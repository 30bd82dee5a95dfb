"""`epikv serve --ray-replicas`: two Ray Serve replicas of the server on a local 2-CPU Ray cluster
started here, over a local folder holding a tiny random model, answering the `openai` client."""

from __future__ import annotations

import concurrent.futures
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from epikv.cli import main as epikv_main
from epikv.serve.ray_serve import REPLICA_HEADER, ReplicaResources, ReplicaSettings
from tests.helpers.ray_cluster import local_cluster, ray_test
from tests.helpers.serve import free_port


@pytest.fixture(scope="module")
def replicas(serve_model_folder) -> Iterator[str]:
    from ray import serve

    from epikv.serve.ray_serve import deploy

    with local_cluster(seconds=240):  # about 40 s when nothing hangs
        settings = ReplicaSettings(
            model=str(serve_model_folder), served_model_name="m", policy="streaming", budget="64",
            max_tokens=16, threads=1,
        )  # fmt: skip
        yield deploy(settings, ReplicaResources(replicas=2, cpus=1, gpus=0), "127.0.0.1", free_port())
        serve.shutdown()


def ask(client: Any, question: str) -> tuple[str, str]:
    """One chat completion; returns (replica id, text)."""
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": question}], max_tokens=4, temperature=0
    )
    completion = raw.parse()
    assert completion.usage.completion_tokens == 4 and completion.choices[0].finish_reason == "length"
    return raw.headers[REPLICA_HEADER], completion.choices[0].message.content


@ray_test
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Serve's own pydantic fields, on import
def test_two_replicas_answer_the_openai_client_and_both_take_requests(replicas: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{replicas}/v1", api_key="none", max_retries=0, timeout=60)
    assert [model.id for model in client.models.list()] == ["m"]
    seen: dict[str, set[str]] = {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(6):  # concurrent rounds until both replicas answered (almost always the first)
            for replica, text in pool.map(lambda _: ask(client, "Say hi."), range(4)):
                seen.setdefault(replica, set()).add(text)
            if len(seen) == 2:
                break
    assert len(seen) == 2, f"one replica took every request: {seen}"
    # The same weights, prompt and greedy decoding on each replica: the same text everywhere.
    assert len(set().union(*seen.values())) == 1
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) in seen[replica]
    error = httpx.post(f"{replicas}/v1/chat/completions", json={"model": "other", "messages": []}, timeout=30)
    assert error.status_code in (400, 404) and "error" in error.json()


def test_replica_flags_without_replicas_and_replicas_without_ray(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert epikv_main(["serve", "--replica-gpus", "1"]) == 2
    assert capsys.readouterr().err == "epikv: error: --replica-gpus only apply with --ray-replicas\n"
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert epikv_main(["serve", "--ray-replicas", "2", "--policy", "streaming", "--budget", "64"]) == 2
    assert (
        capsys.readouterr().err
        == "epikv: error: Ray is not installed; install it with: pip install 'epikv[ray]'\n"
    )


def test_replica_settings_are_the_serve_flags() -> None:
    from epikv.cli import build_parser

    argv = ["serve", "--ray-replicas", "2", "--model", "m/x", "--policy", "streaming", "--budget", "99"]
    argv += ["--param", "n_sink=2", "--kv-pool", "4096", "--max-tokens", "64", "--threads", "3"]
    settings = ReplicaSettings.from_args(build_parser().parse_args(argv))
    assert (settings.model, settings.policy, settings.budget, settings.params) == (
        "m/x",
        "streaming",
        "99",
        ("n_sink=2",),
    )
    assert (settings.kv_pool, settings.max_tokens, settings.threads, settings.max_waiting) == (
        4096,
        64,
        3,
        64,
    )
    assert settings.budget_tokens() == 99
    auto = ReplicaSettings.from_args(build_parser().parse_args(["serve", "--ray-replicas", "2"]))
    assert auto.threads is None  # --threads auto: a replica keeps the threads Ray starts it with
    with pytest.raises(ValueError):
        ReplicaSettings(policy="streaming", params=("no_such_field=1",)).budget_tokens()
