"""``epikv serve``: argument parsing and starting uvicorn (the work is in :mod:`epikv.serve`)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from epikv.models.loading import DTYPE_CHOICES, DTYPE_HELP
from epikv.serve.limits import ServeLimits, limits_from_args
from epikv.serve.ray_serve import add_ray_serve_arguments, ray_requested, serve_on_ray
from epikv.spec import ATTENTION_MODES, RANK_EVERY_HELP
from epikv.threads import THREADS_HELP, apply_threads

log = logging.getLogger(__name__)
API_KEY_ENV = "EPIKV_API_KEY"


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible server with continuous batching and eviction")
    p.add_argument("--model", default=None, help="hub id or local path (default: the embedded SmolLM2-135M)")
    p.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: the model's)"
    )
    p.add_argument("--policy", default="epikv", help="eviction policy (see `epikv policies`)")
    p.add_argument("--budget", default="256", help="KV budget K per request, in tokens (ignored by full)")
    p.add_argument(
        "--interval", type=int, default=None, help="compaction interval tau (default: the policy's)"
    )
    p.add_argument("--rank-every", default=None, metavar="N", help=RANK_EVERY_HELP)
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="policy hyperparameter")
    p.add_argument("--attention", default=ATTENTION_MODES[0], choices=ATTENTION_MODES)
    p.add_argument("--kv-pool", type=int, default=None, help="KV slots all running requests may reserve")
    p.add_argument(
        "--max-batch", type=int, default=None, help="requests decoded together (default: no limit)"
    )
    p.add_argument("--max-waiting", type=int, default=64, help="requests that may queue before 429")
    p.add_argument("--max-tokens", type=int, default=2048, help="largest max_tokens a request may ask for")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", default="auto", help=THREADS_HELP)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--drain-seconds", type=float, default=5.0, help="on SIGTERM, wait this long, then cancel")
    add_access_arguments(p)
    add_ray_serve_arguments(p)
    p.set_defaults(func=cmd_serve)


def add_access_arguments(p: argparse.ArgumentParser) -> None:
    """The key, the limits and the access log (docs/serving.md, "Keys and limits")."""
    defaults = ServeLimits()
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV}, else open)",
    )
    p.add_argument("--protect-metrics", action="store_true", help="/metrics requires the key too")
    p.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes, help="larger bodies: 413")
    p.add_argument(
        "--max-json-depth", type=int, default=defaults.max_json_depth, help="deeper JSON nesting: 400"
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longer prompts: 400 (default: the model's context)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout_s,
        help="seconds after which a request is stopped, its row freed, and it ends with 408 (0: none)",
    )
    p.add_argument("--retry-after", type=int, default=defaults.retry_after_s, help="Retry-After of a 429 (s)")
    p.add_argument("--no-access-log", action="store_true", help="no JSON access-log line per request")


def serve_limits(args: argparse.Namespace) -> tuple[ServeLimits, Any]:
    from epikv.serve.gate import Access

    return limits_from_args(args), Access(args.api_key or None, args.protect_metrics)


def batch_promise(dtype: Any) -> str:
    """What a request in the running batch yields against its solo run, in ``dtype`` (README)."""
    if str(dtype) == "torch.float32":
        return "a batched request yields exactly its solo tokens"
    return "a batched request may part from its solo tokens at a near tie (exact: --dtype float32)"


def cmd_serve(args: argparse.Namespace) -> int:
    if ray_requested(args):
        return serve_on_ray(args)
    try:
        import uvicorn

        from epikv.serve import build_app
    except ImportError as err:
        raise ImportError(
            f"{err.name} is missing; install the server with: pip install 'epikv[serve]'"
        ) from err
    from epikv.engine import SchedulerLimits
    from epikv.integration import build_spec
    from epikv.models import load_model, model_identity, resolve_dtype
    from epikv.spec import precheck

    # mistakes fail before the model loads
    budget = precheck(args.policy, args.budget, args.param, args.interval, args.rank_every)
    http_limits, access = serve_limits(args)
    limits = SchedulerLimits(args.kv_pool, args.max_batch, args.max_waiting)
    threads = apply_threads(args.threads)
    dtype, dtype_note = resolve_dtype(args.dtype)
    threads = f"{threads}; {dtype_note}; {batch_promise(dtype)}"
    model, tokenizer = load_model(args.model, dtype=dtype)
    spec = build_spec(
        model, args.policy, budget, interval=args.interval, attention=args.attention, params=args.param,
        rank_every=args.rank_every,
    )  # fmt: skip
    name = args.served_model_name or model_identity(model)
    app = build_app(model, tokenizer, spec, limits, name, args.max_tokens, http_limits, access)
    if not args.no_access_log:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_log = logging.getLogger("epikv.serve.access")  # epikv.serve.gate.ACCESS_LOG
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False
    key = "an API key" if access.api_key else "no API key"
    log.warning(
        "epikv serve: %s, model %s, %s, %s, %s, on http://%s:%d",
        *(spec.describe(), name, limits, threads, key, args.host, args.port),
    )
    drain = args.drain_seconds

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # On SIGTERM/SIGINT: running requests get ``drain`` seconds, then end with an error chunk,
            # so every connection closes before uvicorn's own deadline (a backstop) cuts it.
            app.state.worker.drain(drain)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, host=args.host, port=args.port, timeout_graceful_shutdown=drain + 5, log_level="warning"
    )
    Server(config).run()
    return 0
