"""A kvpage application on Ray Serve: :func:`build_app` and :func:`serve_on_ray`.

The application is an ingress (:mod:`kvpage.ray.ingress`, no CPU reserved) in front of
``replicas`` kvpage engines (:mod:`kvpage.ray.replica`), each one Ray actor with
``num_cpus_per_replica`` CPUs and ``num_gpus_per_replica`` GPUs, so Ray places them
(one per host when a host has room for one) and restarts one whose actor or engine
died (health check every 5 s). ``max_replicas`` above ``replicas`` turns on Ray's
autoscaling on ongoing requests per replica (``target_ongoing_requests``).

The request router is chosen by ``router``: ``kvpage`` (default: the engines' own
prefix caches, :mod:`kvpage.ray.router`), ``pow2`` (Ray's default power-of-two
choices) or ``prefix`` (Ray's text-matching ``PrefixCacheAffinityRouter``).

Two entry points build the same application:

- ``kvpage serve MODEL --replicas N [--ray-address ADDR]`` (:func:`serve_on_ray`);
- ``serve run kvpage.ray:app model=MODEL replicas=N ...`` or a Serve config file naming
  ``import_path: kvpage.ray:app`` with ``args`` (:func:`app`): every other key is a
  ``kvpage serve`` flag (``max_num_seqs=64``, ``kv_cache_dtype=float16``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
from typing import Any

logger = logging.getLogger(__name__)

ROUTERS = {
    "kvpage": "kvpage.ray.router:KvpageRouter",
    "pow2": None,  # Ray's default, PowerOfTwoChoicesRequestRouter
    # its public alias, ray.serve.llm.request_router, imports vLLM or SGLang: the class from
    # the module that defines it
    "prefix": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
              "PrefixCacheAffinityRouter",
}

APP_KEYS = {"model", "replicas", "max_replicas", "router", "num_cpus_per_replica",
            "num_gpus_per_replica", "pin_cpus", "routing_stats_period_s"}
"""The keys of :func:`app`'s arguments that are not ``kvpage serve`` flags."""


@dataclasses.dataclass
class RayOptions:
    """How the replicas are placed and routed."""

    replicas: int = 1
    max_replicas: int | None = None
    router: str = "kvpage"
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    pin_cpus: bool = False
    routing_stats_period_s: float = 1.0

    def check(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {self.replicas}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"--max-replicas {self.max_replicas} is below --replicas "
                             f"{self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, "
                             f"got {self.router!r}")


def _import(path: str) -> Any:
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def build_app(replica_options: Any, ray_options: RayOptions) -> Any:
    """The Serve application: ingress + replicas (module docs)."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from kvpage.ray.ingress import KvpageIngress
    from kvpage.ray.replica import KvpageReplica

    ray_options.check()
    config = replica_options.engine_config
    router_kwargs: dict[str, Any] = {}
    router_path = ROUTERS[ray_options.router]
    if ray_options.router == "kvpage":
        router_kwargs = {"block_size": config.block_size}
    router_config = RequestRouterConfig(
        **({} if router_path is None else {"request_router_class": _import(router_path)}),
        request_router_kwargs=router_kwargs,
        request_routing_stats_period_s=ray_options.routing_stats_period_s,
        request_routing_stats_timeout_s=max(5.0, 5 * ray_options.routing_stats_period_s))
    scaling: dict[str, Any] = {"num_replicas": ray_options.replicas}
    if ray_options.max_replicas is not None and ray_options.max_replicas > ray_options.replicas:
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=ray_options.replicas, max_replicas=ray_options.max_replicas,
            target_ongoing_requests=max(1, config.max_num_seqs // 2))}
    replica = serve.deployment(
        KvpageReplica, name="KvpageReplica",
        ray_actor_options={"num_cpus": ray_options.num_cpus_per_replica,
                           "num_gpus": ray_options.num_gpus_per_replica},
        max_ongoing_requests=config.max_num_seqs,
        health_check_period_s=5.0, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=30.0,
        request_router_config=router_config, **scaling)
    ingress = serve.deployment(KvpageIngress, name="KvpageIngress",
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000)
    return ingress.bind(replica.bind(replica_options), replica_options.model)


def options_from_args(args: argparse.Namespace) -> tuple[Any, RayOptions]:
    """The replica and Ray options of parsed ``kvpage serve`` flags."""
    from kvpage.engine.config import engine_config_from_args
    from kvpage.ray.replica import ReplicaOptions

    if args.warmup is None:
        args.warmup = "background"
    replica = ReplicaOptions(
        model=args.model, engine_config=engine_config_from_args(args, args.model),
        served_model_name=args.served_model_name, api_key=args.api_key,
        public_metrics=bool(args.public_metrics), metrics_prefix=args.metrics_prefix,
        pin_cpus=bool(getattr(args, "pin_cpus", False)))
    ray_options = RayOptions(**{f.name: getattr(args, f.name) for f in
                                dataclasses.fields(RayOptions) if hasattr(args, f.name)})
    ray_options.check()
    return replica, ray_options


def app(args: dict[str, Any]) -> Any:
    """``serve run kvpage.ray:app model=MODEL replicas=2 max_num_seqs=64``: the
    application of those ``kvpage serve`` flags."""
    from kvpage.serve_args import parse_serve_args

    args = dict(args)
    if "model" not in args:
        raise ValueError("kvpage.ray:app needs model=MODEL (an HF directory or a .gguf file)")
    argv = [str(args.pop("model"))]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True or str(value).lower() == "true":
            argv.append(flag)
        elif value is not False and str(value).lower() != "false":
            argv += [flag, str(value)]
    parsed = parse_serve_args(argv)
    return build_app(*options_from_args(parsed))


def serve_on_ray(args: argparse.Namespace) -> None:
    """``kvpage serve MODEL --replicas N``: start (or join, with ``--ray-address``) a Ray
    cluster, run the application on ``--host:--port`` until SIGINT/SIGTERM, then shut
    Serve down (each replica's engine finishes or aborts its requests)."""
    import ray
    from ray import serve

    replica_options, ray_options = options_from_args(args)
    ray.init(address=args.ray_address, log_to_driver=False)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(replica_options, ray_options), name="kvpage", route_prefix="/",
                  blocking=False)
        logger.info("kvpage on Ray: %d replica(s) of %s, router %s, http://%s:%d",
                    ray_options.replicas, args.model, ray_options.router, args.host, args.port)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
