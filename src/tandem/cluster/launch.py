"""`tandem serve --replicas N`: start Ray on this machine, deploy the cluster app, serve until
SIGINT / SIGTERM, then shut Serve and Ray down."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from typing import TextIO


def default_replica_cpus(replicas: int, cpus: int | None = None) -> float:
    """This machine's CPUs shared evenly (fractional: 2 replicas on 3 cores get 1.5 each)."""
    return round((cpus or os.cpu_count() or 1) / max(1, replicas), 3)


def serve_cluster(a: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        from tandem.errors import ConfigError

        raise ConfigError("--replicas needs Ray Serve: pip install 'tandem[cluster]'") from None
    from tandem.cli_engine import served_model_name
    from tandem.cluster.deployments import build
    from tandem.server.launch import usage_banner

    cpus = os.cpu_count() or 1
    if a.replica_cpus is None:
        a.replica_cpus = default_replica_cpus(a.replicas, cpus)
    if a.ray_address:
        ray.init(address=a.ray_address, logging_level="WARNING")
    else:
        ray.init(num_cpus=max(cpus, math.ceil(a.replicas * a.replica_cpus)), include_dashboard=False,
                 logging_level="WARNING")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": a.host, "port": a.port})
        serve.run(build(a), name="tandem", route_prefix="/")
        name = a.served_model_name or served_model_name(a.model)
        print(usage_banner(a.host, a.port, name, a.api_key).rstrip("\n")
              + f"\n  {a.replicas} replicas on Ray Serve, {a.replica_cpus:g} CPUs each "
                f"(GET /health: all replicas; /metrics: a replica label per replica)\n", file=out, flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
