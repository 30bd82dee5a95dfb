"""``epikv serve``: argument parsing and starting uvicorn (the work is in :mod:`epikv.serve`)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from epikv.serve.ray_serve import add_ray_serve_arguments, ray_requested, serve_on_ray
from epikv.threads import THREADS_HELP, apply_threads

log = logging.getLogger(__name__)


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
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="policy hyperparameter")
    p.add_argument("--attention", default="recompute", choices=("recompute", "eager"))
    p.add_argument("--kv-pool", type=int, default=None, help="KV slots all running requests may reserve")
    p.add_argument(
        "--max-batch", type=int, default=None, help="requests decoded together (default: no limit)"
    )
    p.add_argument("--max-waiting", type=int, default=64, help="requests that may queue before 429")
    p.add_argument("--max-tokens", type=int, default=2048, help="largest max_tokens a request may ask for")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", default="auto", help=THREADS_HELP)
    p.add_argument("--drain-seconds", type=float, default=5.0, help="on SIGTERM, wait this long, then cancel")
    add_ray_serve_arguments(p)
    p.set_defaults(func=cmd_serve)


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
    from epikv.models import load_model, model_identity
    from epikv.policies import policy_class
    from epikv.spec import parse_budget, parse_policy_params

    parse_policy_params(policy_class(args.policy), args.param)  # mistakes fail before the model loads
    budget = parse_budget(args.budget) if policy_class(args.policy).evicts else None
    limits = SchedulerLimits(args.kv_pool, args.max_batch, args.max_waiting)
    threads = apply_threads(args.threads)
    model, tokenizer = load_model(args.model)
    spec = build_spec(
        model, args.policy, budget, interval=args.interval, attention=args.attention, params=args.param
    )
    name = args.served_model_name or model_identity(model)
    app = build_app(model, tokenizer, spec, limits, name, args.max_tokens)
    log.warning(
        "epikv serve: %s, model %s, %s, %s, on http://%s:%d",
        *(spec.describe(), name, limits, threads, args.host, args.port),
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
