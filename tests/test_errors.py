"""One line and an exit status for every mistake a user can make (issue #12 item 7)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

import epikv.models
from epikv.cli import main
from epikv.errors import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, Interrupted, one_line

SRC = Path(__file__).resolve().parents[1] / "src"


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    return error_line_of(capsys.readouterr().err)


def error_line_of(err: str) -> str:
    """The one line a failure prints ("[epikv] ..." status lines, e.g. the spec in use, aside)."""
    lines = [line for line in err.strip().splitlines() if not line.startswith("[epikv] ")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("/nonexistent", "epikv: error: model '/nonexistent': no such local folder"),
        ("random:tiny-llama", "epikv: error: model 'random:tiny-llama' has random weights"),
    ],
)
def test_a_model_that_cannot_load_is_one_line(capsys, model, message):
    assert main(["generate", "--model", model, "hi"]) == 2
    assert error_line(capsys).startswith(message)


def test_a_multi_line_library_message_becomes_one_line(capsys, monkeypatch):
    hub = logging.getLogger("huggingface_hub")
    monkeypatch.setattr(hub, "level", hub.level)  # restored after the test

    def offline(name, **kwargs):
        # Offline, the hub logs each of its retries before failing: not above our one line.
        assert not logging.getLogger("huggingface_hub.utils._http").isEnabledFor(logging.WARNING)
        raise epikv.models.ModelLoadError(f"could not load model {name!r}: We couldn't connect.\nCheck it.")

    monkeypatch.setattr(epikv.models, "load_model", offline)
    assert main(["generate", "--model", "org/name", "hi"]) == 2
    line = error_line(capsys)
    assert line == "epikv: error: could not load model 'org/name': We couldn't connect. Check it."


def test_a_bad_policy_parameter_is_one_line(capsys):
    assert main(["generate", "--param", "window=abc", "hi"]) == 2
    assert error_line(capsys) == "epikv: error: epikv-segq: parameter window='abc' is not an integer"


def test_verbose_keeps_the_traceback(capsys):
    with pytest.raises(OSError, match="no such local folder"):
        main(["-v", "generate", "--model", "/nonexistent", "hi"])


def test_a_reader_that_leaves_ends_the_command_quietly():
    # `epikv policies --json | head`: the pipe is closed before anything is written.
    process = subprocess.Popen(
        [sys.executable, "-m", "epikv.cli", "policies", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=60) == EXIT_BROKEN_PIPE
    assert err == ""


def test_ctrl_c_exits_130_with_what_was_kept(capsys, monkeypatch):
    import epikv.cli as cli

    def interrupted(args):
        raise Interrupted("kept 3 results in runs/x")

    monkeypatch.setattr(cli, "cmd_policies", interrupted)
    assert main(["policies"]) == EXIT_INTERRUPTED
    assert error_line(capsys) == "epikv: interrupted: kept 3 results in runs/x"


def test_one_line_names_an_empty_error():
    assert one_line(ValueError()) == "ValueError"
    assert one_line(OSError("a\n  b")) == "a b"


def test_ctrl_c_during_generate_says_how_far_it_got(capsys, monkeypatch, tiny_llama, tok):
    import epikv.generation

    def interrupted_generate(model, tokenizer, prompts, spec, on_token=None, **kwargs):
        for token in (40, 41, 42):
            on_token(0, token)
        raise KeyboardInterrupt

    monkeypatch.setattr(epikv.models, "load_model", lambda name, **_: (tiny_llama, tok))
    monkeypatch.setattr(epikv.generation, "generate", interrupted_generate)
    assert main(["generate", "--policy", "streaming", "hi"]) == EXIT_INTERRUPTED
    captured = capsys.readouterr()
    assert captured.out.endswith("\n")  # the streamed text's line is ended before the summary
    assert error_line_of(captured.err) == "epikv: interrupted: after 3 generated tokens (shown above)"


def test_a_prompt_past_the_context_is_one_line(capsys, monkeypatch, tiny_llama, tok):
    monkeypatch.setattr(epikv.models, "load_model", lambda name, **_: (tiny_llama, tok))
    assert main(["generate", "--policy", "streaming", "x" * 5000]) == 2
    assert (
        error_line(capsys)
        == "epikv: error: the prompt has 5000 tokens but the model's context is 4096 tokens"
    )


def test_a_long_prefill_shows_progress(capsys, monkeypatch, tiny_llama, tok):
    monkeypatch.setattr(epikv.models, "load_model", lambda name, **_: (tiny_llama, tok))
    argv = ["generate", "--json", "--policy", "streaming", "--max-new-tokens", "2", "y" * 3000]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "prefill: 100%" in err and "3000/3000" in err
