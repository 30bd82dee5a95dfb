"""`epikv serve --ray-replicas N`: the OpenAI server as a Ray Serve deployment.

Owns the replica: each one loads the model and builds the very app `epikv serve` runs
(:func:`epikv.serve.build_app`: its own engine thread, admission by KV slots, metrics), which Ray
Serve mounts with ``serve.ingress``, so every replica answers the same OpenAI routes and Ray Serve's
proxy spreads requests over them. Each response names its replica in the ``x-epikv-replica``
header. It knows nothing of the routes themselves, and nothing here runs without Ray.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

from epikv.cluster import connected, gpus_or_default, import_ray, import_serve
from epikv.serve.limits import ServeLimits, limits_from_args
from epikv.threads import parse_threads

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-epikv-replica"
APP_NAME = "epikv"
DEPLOYMENT_NAME = "EpikvServer"


@dataclass(frozen=True)
class ReplicaSettings:
    """The `epikv serve` flags that shape one server; every replica builds its app from these."""

    model: str | None = None
    served_model_name: str | None = None
    policy: str = "epikv"
    budget: str = "256"
    interval: int | None = None
    rank_every: str | None = None
    params: tuple[str, ...] = ()
    attention: str = "recompute"
    kv_pool: int | None = None
    max_batch: int | None = None
    max_waiting: int = 64
    max_tokens: int = 2048
    threads: int | None = None
    serve_limits: ServeLimits = field(default_factory=ServeLimits)
    api_key: str | None = None  # travels to the replicas pickled in the deployment's arguments
    protect_metrics: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplicaSettings:
        own = ("params", "threads", "serve_limits")
        names = [name for name in cls.__dataclass_fields__ if name not in own]
        # --threads auto: a replica keeps the threads Ray starts it with (set --threads to choose)
        threads = parse_threads(args.threads)
        fields = {name: getattr(args, name) for name in names}
        return cls(params=tuple(args.param), threads=threads, serve_limits=limits_from_args(args), **fields)

    def budget_tokens(self) -> int | None:
        """The budget as the engine takes it; raises ValueError for a bad budget or policy parameter,
        so mistakes surface before any replica starts (:func:`epikv.spec.precheck`)."""
        from epikv.spec import precheck

        return precheck(self.policy, self.budget, self.params, self.interval, self.rank_every)


@dataclass(frozen=True)
class ReplicaResources:
    """replicas: engines behind the proxy; gpus None = 1 when the cluster has GPUs, else 0;
    max_ongoing: requests Ray Serve hands one replica at once (more wait in Ray's router), which
    caps that replica's batch; the engine's own --max-batch / --kv-pool / --max-waiting still apply."""

    replicas: int = 1
    cpus: float = 1.0
    gpus: float | None = None
    max_ongoing: int = 64
    drain_seconds: float = 5.0

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.max_ongoing < 1:
            raise ValueError(
                f"replicas and max_ongoing must be >= 1, got {self.replicas}, {self.max_ongoing}"
            )
        if self.cpus < 0 or (self.gpus is not None and self.gpus < 0):
            raise ValueError(f"replica resources must be >= 0, got {self.cpus} CPUs, {self.gpus} GPUs")


class ReplicaHeader:
    """ASGI middleware naming the replica in every HTTP response (streams included)."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


def build_replica_app(settings: ReplicaSettings, replica: str) -> Any:
    """One replica's app: the model loaded here, the same app `epikv serve` runs, tagged with `replica`."""
    import torch

    from epikv.engine import SchedulerLimits
    from epikv.integration import build_spec
    from epikv.models import load_model, model_identity
    from epikv.serve import Access, build_app

    budget = settings.budget_tokens()
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    model, tokenizer = load_model(settings.model)
    spec = build_spec(
        model, settings.policy, budget, interval=settings.interval, attention=settings.attention,
        params=list(settings.params), rank_every=settings.rank_every,
    )  # fmt: skip
    limits = SchedulerLimits(settings.kv_pool, settings.max_batch, settings.max_waiting)
    name = settings.served_model_name or model_identity(model)
    access = Access(settings.api_key or None, settings.protect_metrics)
    app = build_app(model, tokenizer, spec, limits, name, settings.max_tokens, settings.serve_limits, access)
    app.add_middleware(ReplicaHeader, replica=replica)
    return app


def application(settings: ReplicaSettings, resources: ReplicaResources, gpus: float) -> Any:
    """The bound Ray Serve application: `resources.replicas` replicas of the epikv server."""
    serve = import_serve()

    @serve.ingress()  # the app is built in each replica, after its model loads
    class EpikvServer:
        def __init__(self, settings: ReplicaSettings) -> None:
            replica = serve.get_replica_context().replica_id.unique_id
            self._app = build_replica_app(settings, replica)

        def __serve_build_asgi_app__(self) -> Any:
            return self._app

        def check_health(self) -> None:  # Ray Serve restarts a replica whose engine thread died
            if not self._app.state.worker.alive:
                raise RuntimeError("the engine thread has stopped")

    deployment = serve.deployment(
        EpikvServer,
        name=DEPLOYMENT_NAME,
        num_replicas=resources.replicas,
        ray_actor_options={"num_cpus": resources.cpus, "num_gpus": gpus},
        max_ongoing_requests=resources.max_ongoing,
        graceful_shutdown_timeout_s=resources.drain_seconds,
    )
    return deployment.bind(settings)


def deploy(settings: ReplicaSettings, resources: ReplicaResources, host: str, port: int) -> str:
    """Starts Serve's proxy on host:port and runs the application (Ray must be initialised); returns
    the base URL once every replica is up."""
    serve = import_serve()
    settings.budget_tokens()
    gpus = gpus_or_default(import_ray(), resources.gpus)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(settings, resources, gpus), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def add_ray_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The Ray Serve flags of `epikv serve`."""
    group = parser.add_argument_group(
        "Ray Serve (pip install 'epikv[ray]'; the cluster in RAY_ADDRESS, else local)"
    )
    group.add_argument(
        "--ray-replicas", type=int, default=None, help="serve N replicas behind Ray Serve's proxy"
    )
    group.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs each replica reserves")
    group.add_argument(
        "--replica-gpus",
        type=float,
        default=None,
        help="GPUs each replica reserves (default: 1 if the cluster has any)",
    )
    group.add_argument(
        "--replica-max-ongoing", type=int, default=64, help="requests Ray Serve sends one replica at once"
    )


def ray_requested(args: argparse.Namespace) -> bool:
    """Whether `--ray-replicas` was given; replica flags without it are an error rather than ignored."""
    if getattr(args, "ray_replicas", None) is not None:
        return True
    defaults = {"replica_cpus": 1.0, "replica_gpus": None, "replica_max_ongoing": 64}
    stray = [name for name, default in defaults.items() if getattr(args, name, default) != default]
    if stray:
        flags = ", ".join("--" + name.replace("_", "-") for name in stray)
        raise ValueError(f"{flags} only apply with --ray-replicas")
    return False


def serve_on_ray(args: argparse.Namespace) -> int:
    """`epikv serve --ray-replicas N`: deploys, then serves until SIGINT or SIGTERM."""
    settings = ReplicaSettings.from_args(args)
    resources = ReplicaResources(
        args.ray_replicas, args.replica_cpus, args.replica_gpus, args.replica_max_ongoing, args.drain_seconds
    )
    settings.budget_tokens()  # mistakes fail before Ray starts
    with connected(None):
        url = deploy(settings, resources, args.host, args.port)
        log.warning(
            "epikv serve: %d Ray Serve replicas of %s on %s", resources.replicas, settings.policy, url
        )
        _wait_for_signal()
        import_serve().shutdown()
    return 0


def _wait_for_signal() -> None:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
