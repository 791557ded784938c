"""AugServe's Stage I predictors, trained offline on a held-out trace and evaluated on another.

Stage I ranks requests by predicted service time from what is known at arrival (prompt length,
the prompt's first tokens, the declared tool set or workload type), so it needs a predictor that
has seen the workload family before: `train` fits the output-length ridge regression and the
per-type tool statistics (mean calls per request, call duration, returned tokens) on one seed of
the simulator's workload, and `evaluate` reports Kendall's tau between predicted and actual output
lengths on another seed. Requests are built exactly as the simulator builds them (its prompt token
ids, its tool keys), so the features match what the scheduler will see.

    tandem predictor train [--requests 3000] [--seed 1] [--eval-seed 2] --json PATH

writes the state (`make_policy(trained=...)`, `tandem simulate --predictor PATH`).
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from collections.abc import Iterable
from statistics import fmean
from typing import Any

from tandem.sampling_params import SamplingParams
from tandem.sched.ordering import tool_key
from tandem.sched.predictor import OutputLengthPredictor, ToolStats, kendall_tau
from tandem.sim.engine import prompt_token_ids
from tandem.sim.workload import SimRequest, WorkloadSpec, build_workload
from tandem.types import Request

FORMAT = "tandem-predictor/1"


def as_request(spec: SimRequest, index: int) -> Request:
    """The scheduler's view of a simulated request at arrival (as tandem.sim.engine admits it)."""
    params = SamplingParams(max_tokens=max(1, spec.output_tokens), temperature=0.0, ignore_eos=True)
    r = Request(spec.request_id, prompt_token_ids(index, spec.prompt_tokens), params)
    if spec.has_tools:
        r.tool.key = spec.kind
    return r


def fit(samples: Iterable[tuple[Request, int, list[tuple[float, int]]]]) -> dict[str, Any]:
    """Predictor state from (request as the scheduler sees it at arrival, its output tokens, its tool
    calls as (seconds, returned tokens)); tool statistics are per request's `tool.key` (exact means)."""
    lengths = OutputLengthPredictor()
    durations, returned, calls = defaultdict(list), defaultdict(list), defaultdict(list)
    n = 0
    for request, output_tokens, made in samples:
        lengths.observe(request, output_tokens, refit=False)
        key = tool_key(request)
        calls[key].append(len(made))
        for seconds, tokens in made:
            durations[key].append(seconds)
            returned[key].append(tokens)
        n += 1
    lengths.refit()
    tools = ToolStats().state()
    tools["duration_s"] = {k: fmean(v) for k, v in durations.items()}
    tools["return_tokens"] = {k: fmean(v) for k, v in returned.items()}
    tools["calls"] = {k: fmean(v) for k, v in calls.items()}
    return {"format": FORMAT, "lengths": lengths.state(), "tools": tools, "trained_on": {"num_requests": n},
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def calls_of(segments) -> list[tuple[float, int]]:
    return [(s.api_time_s, s.return_tokens) for s in segments if s.has_call]


def train(workload: WorkloadSpec, seed: int) -> dict[str, Any]:
    """Fit the predictors on the simulator's workload drawn with `seed` (make_policy's `trained`)."""
    reqs = build_workload(workload, seed)
    state = fit((as_request(spec, i), spec.output_tokens, calls_of(spec.segments)) for i, spec in enumerate(reqs))
    state["trained_on"].update(dataset=workload.dataset, seed=seed, builder="simulator")
    return state


def evaluate(state: dict[str, Any], workload: WorkloadSpec, seed: int) -> dict[str, Any]:
    """Kendall's tau between predicted and actual output lengths on the workload drawn with `seed`."""
    check(state)
    lengths = OutputLengthPredictor.from_state(state["lengths"])
    reqs = build_workload(workload, seed)
    predicted = [lengths.predict(as_request(s, i)) for i, s in enumerate(reqs)]
    actual = [s.output_tokens for s in reqs]
    return {"seed": seed, "num_requests": len(reqs), "kendall_tau": kendall_tau(predicted, actual)}


def check(state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"not a predictor state of format {FORMAT!r} (train one with `tandem predictor train`)")
