"""Scale out: N Tandem replicas on Ray Serve behind one OpenAI-compatible ingress, routed by
`tandem.router` (sessions, prompt prefixes, tool pauses, load).

Ray is an optional extra (`pip install 'tandem[cluster]'`); it is imported only when an
application is built, so `import tandem.cluster` works without it.

    tandem serve --replicas 2 [tandem serve's flags]          # starts Ray locally
    serve run tandem.cluster:app model=/path/to/model replicas=2 replica_cpus=1
    serve deploy config.yaml                                   # import_path: tandem.cluster:app

`app(args)` is a Ray Serve application builder: `args` are `tandem serve`'s flags as keys
(underscores or dashes; `true` for switches), plus `replicas`, `replica_cpus`, `router_policy`.
"""

from __future__ import annotations

from typing import Any


def args_to_argv(args: dict[str, Any] | None) -> list[str]:
    """{"model": "m", "max_num_seqs": 16, "no_prefix_caching": True} -> tandem serve's argv."""
    argv: list[str] = []
    for key, value in (args or {}).items():
        flag = "--" + str(key).replace("_", "-")
        if value is True or (isinstance(value, str) and value.lower() == "true"):
            argv.append(flag)
        elif value is False or value is None or (isinstance(value, str) and value.lower() == "false"):
            continue
        else:
            argv += [flag, str(value)]
    return argv


def parse_args(args: dict[str, Any] | None):
    """`tandem serve`'s parsed arguments for an application builder's `args`."""
    from tandem.cli_engine import serve_parser

    return serve_parser().parse_args(args_to_argv(args))


def app(args: dict[str, Any] | None = None):
    """Ray Serve application builder (`serve run tandem.cluster:app key=value ...`)."""
    from tandem.cluster.deployments import build

    a = parse_args(args)
    if a.replicas < 1:
        a.replicas = 1
    return build(a)


__all__ = ["app", "args_to_argv", "parse_args"]
