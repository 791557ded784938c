"""`tandem serve`'s own flags (the engine's come from tandem.cli_engine's `add_model_args`): HTTP, limits,
server-side tools, scale-out on Ray Serve, and vLLM's chat-output flags."""

from __future__ import annotations

import argparse


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: local only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the /v1 routes (as vLLM: /health, /metrics, "
                        "/version, /tokenize and /detokenize stay public)")
    s.add_argument("--metrics-prefix", default="tandem,vllm", type=_prefixes, metavar="tandem,vllm",
                   help="/metrics name prefixes, comma-separated: tandem, vllm (vLLM's dashboards) or both (default)")
    s.add_argument("--strict", action="store_true",
                   help="answer a request field the server does not know with a 400 (default: log it and ignore it)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model directory's name; 'default' also works)")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="waiting requests before answering 503 (a request with more choices, n times its "
                        "prompts, gets 400)")
    s.add_argument("--max-request-bytes", type=int, default=2 * 2**20, help="larger request bodies get 413")
    s.add_argument("--max-tokens-limit", type=int, default=4096, help="the largest max_tokens a request may ask")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to let in-flight requests finish on SIGTERM (then streams end with an "
                        "error event and [DONE], whole responses get 503)")
    s.add_argument("--tools", default="", help="server-side built-in tools, e.g. calculator,retrieve")
    s.add_argument("--tools-module", default=None, help="a module whose register(registry) adds Python tools")
    s.add_argument("--tools-docs", default=None, help="folder of .txt/.md documents for the retrieve tool")
    _cluster_args(s)
    _chat_args(s)


def _prefixes(text: str) -> tuple[str, ...]:
    names = [n.strip().rstrip(":") for n in text.split(",") if n.strip()]
    if not names or any(n not in ("tandem", "vllm") for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected tandem, vllm or tandem,vllm, got {text!r}")
    return tuple(n + ":" for n in names)


def _cluster_args(s: argparse.ArgumentParser) -> None:
    """`tandem serve --replicas N`: N engines on Ray Serve (tandem.cluster; the `cluster` extra)."""
    c = s.add_argument_group("scale out (Ray Serve; pip install 'tandem[cluster]')")
    c.add_argument("--replicas", type=int, default=1,
                   help="engines to run; 2 or more start Ray on this machine (or join --ray-address) and "
                        "serve them behind one ingress and Tandem's router (default 1: no Ray)")
    c.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs each replica reserves, fractional allowed; torch gets that many threads "
                        "(at least 1) (default: this machine's CPUs / --replicas)")
    c.add_argument("--router-policy", default="tandem",
                   help="tandem.router policy choosing the replica (default tandem: sessions, prefixes, "
                        "tool pauses and load)")
    c.add_argument("--routing-stats-period", type=float, default=1.0,
                   help="seconds between each replica's routing-stats reports (default 1)")
    c.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")


def _chat_args(s: argparse.ArgumentParser) -> None:
    """vLLM's chat-output flags of `tandem serve`: the tool-call format, auto tool choice, reasoning."""
    from tandem.tools.parsers import ALIASES, TOOL_PARSERS
    from tandem.tools.reasoning import REASONING_PARSERS

    c = s.add_argument_group("chat outputs (vLLM's flags)")
    c.add_argument("--tool-call-parser", default="hermes", choices=TOOL_PARSERS + tuple(ALIASES),
                   metavar="{" + ",".join(TOOL_PARSERS) + "}",
                   help="the tool-call format the model writes (default hermes: <tool_call> JSON; vLLM's "
                        + ", ".join(f"{k} ({v})" for k, v in ALIASES.items()) + " work too)")
    c.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help="parse tool calls the model chooses to make (tool_choice auto, the default with "
                        "tools); --no-enable-auto-tool-choice answers such requests with a 400, as vLLM "
                        "does without this flag")
    c.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="return the model's <think> reasoning as message.reasoning / reasoning_content "
                        "(default: off, the reasoning stays in the content)")
    c.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template given in the request (default: a 400)")
