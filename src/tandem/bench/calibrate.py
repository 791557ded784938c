"""`tandem simulate calibrate`: profile this engine on this machine for the simulator.

Builds the real engine (default model and configuration unless told otherwise) and runs short
workloads whose steps cover what the cost model needs: single prefill chunks of 8-1024 tokens,
decode batches of 1-64 sequences at 64-1536 tokens of context, verification of 2-8 n-gram drafts
per request, a mixed batch, and single prompts of 16-408 tokens again at the end. Every engine
step is one sample: its shape (from the plan and the drafts actually verified) and its wall
seconds around `LLMEngine.step()` (schedule + execute + update: what the simulator's virtual step
stands for). The fit and the profile format live in tandem.sim.cost.calibrated. About a minute
on two cores (`quick`: a third of that).
"""

from __future__ import annotations

import datetime
import platform
import random
import statistics
import time
from typing import Any, Callable

import torch

from tandem.config import CacheConfig, ModelConfig, SchedulerConfig, SpecConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.llm import build_engine, reconfigure_speculation
from tandem.models.fetch import resolve_model
from tandem.executor import TorchExecutor
from tandem.sampling_params import SamplingParams
from tandem.sim.cost.base import shape_of
from tandem.sim.cost.calibrated import FORMAT, SHAPE_FIELDS, fit
from tandem.types import StepPlan, StepResult

Log = Callable[[str], None]
PREFILL = (8, 32, 64, 128, 256, 512, 1024)
PREFILL_LATE = (24, 48, 96, 160, 224, 320, 400)
DECODE = ((1, 64), (2, 64), (4, 64), (8, 64), (16, 64), (32, 64), (64, 64), (1, 512), (8, 512), (32, 512),
          (4, 1536))
VERIFY = ((1, 2), (1, 4), (1, 8), (8, 4), (8, 8), (32, 4))


class StepRecorder:
    """Records each model step an engine runs while in the `with` block: its shape (from the plan
    and the drafts actually verified), its wall seconds around `LLMEngine.step()` and the current
    `phase` label, as dicts in `samples` (the profile's sample format)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.phase = engine, ""
        self.samples: list[dict[str, Any]] = []
        self._inner: TorchExecutor | None = None
        self._last: tuple[StepPlan, StepResult] | None = None

    def __enter__(self) -> StepRecorder:
        self._inner = self.engine.executor
        self.engine.executor = self          # stands in for the runner: execute + release
        self._step = self.engine.step
        self.engine.step = self._timed_step  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.executor = self._inner
        del self.engine.step                 # back to the class's method

    def execute(self, plan: StepPlan) -> StepResult:
        result = self._inner.execute(plan)
        self._last = (plan, result)
        return result

    def release(self, request_ids: list[str]) -> None:
        self._inner.release(request_ids)

    def _timed_step(self) -> list[Any]:
        before, self._last = self.engine.last_step, None
        t = time.perf_counter()
        outputs = self._step()
        dt = time.perf_counter() - t
        if self.engine.last_step is not before and self._last is not None:
            plan, result = self._last
            shape = shape_of(plan, result.num_draft_tokens)
            sample = {k: getattr(shape, k) for k in SHAPE_FIELDS}
            sample.update(num_draft_tokens=shape.num_draft_tokens, seconds=dt, phase=self.phase)
            self.samples.append(sample)
        return outputs


class _Session:
    def __init__(self, engine: LLMEngine, recorder: StepRecorder, rng: random.Random) -> None:
        self.engine, self.recorder, self.rng = engine, recorder, rng

    def prompt(self, n: int, period: int | None = None) -> list[int]:
        hi = min(20000, self.engine.vocab_size)
        draw = [self.rng.randrange(hi // 20, hi) for _ in range(period or n)]
        return (draw * (n // len(draw) + 1))[:n]

    def run(self, prompts: list[list[int]], max_tokens: int, phase: str) -> None:
        eng = self.engine
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for p in prompts:
            eng.add_request(prompt_token_ids=p, params=params)
        self.recorder.phase = phase
        while eng.has_unfinished_requests():
            eng.step()


def _copy_bytes_per_s(mb: int = 64) -> float:
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return src.numel() * 4 / statistics.median(times)


def _speculate(engine: LLMEngine, runner: TorchExecutor, k: int | None) -> None:
    """Attach n-gram speculation with k drafts per request (None: detach)."""
    cfg = SpecConfig(method="ngram", policy="fixed", max_draft_tokens=k) if k is not None else None
    reconfigure_speculation(engine, cfg, runner)


def measure(session: _Session, runner: TorchExecutor, quick: bool, log: Log) -> None:
    reps = 1 if quick else 2
    fits = session.engine.max_model_len - 64          # longer prompts are skipped (small-context models)
    session.run([session.prompt(16)], 4, "warmup")
    for t in [t for t in (PREFILL[:-1] if quick else PREFILL) if t < fits]:
        for _ in range(reps):
            session.run([session.prompt(t)], 2, f"prefill-{t}")
    log(f"  prefill done ({len(session.recorder.samples)} steps)")
    for b, c in [(b, c) for b, c in (DECODE[::2] if quick else DECODE) if c < fits]:
        session.run([session.prompt(c) for _ in range(b)], 6 if quick else 8, f"decode-{b}x{c}")
    log(f"  decode done ({len(session.recorder.samples)} steps)")
    for b, k in VERIFY[::2] if quick else VERIFY:
        _speculate(session.engine, runner, k)
        session.run([session.prompt(96, period=8) for _ in range(b)], 16 if quick else 24, f"verify-{b}x{k}")
    _speculate(session.engine, runner, None)
    log(f"  verification done ({len(session.recorder.samples)} steps)")
    rng = session.rng
    mixed = [session.prompt(rng.randint(32, 400)) for _ in range(12 if quick else 24)]
    session.run(mixed, 24 if quick else 48, "mixed")
    log(f"  mixed done ({len(session.recorder.samples)} steps)")
    # Single prompts again at the end, at lengths between the grid's: a machine's speed drifts
    # over a calibration (prefills measured only at its start ran 12% faster than the same
    # prefills a minute later), and serving prefills land anywhere in 16-512 tokens.
    for _ in range(reps):
        for t in [t for t in PREFILL_LATE if t < fits]:
            session.run([session.prompt(t + rng.randint(-8, 8))], 2, f"prefill-late-{t}")
    log(f"  late prefills done ({len(session.recorder.samples)} steps)")


def levels_of(samples: list[dict[str, Any]], cost: Any) -> tuple[float, float]:
    """How fast recorded steps (StepRecorder samples) ran relative to the profile behind `cost` (a
    CalibratedCost), as two levels: (steps that prefill, decode-only steps), each the steps'
    measured seconds over the seconds the profile predicts for the same shapes. A sum over a sum,
    not a mean of per-step ratios: a simulator run at these levels spends as long in each kind of
    step as the recorded run did when it builds the same steps, spikes included, and the long
    steps that decide a timeline weigh as much as they last. Two levels because prefill and decode
    steps drift apart on a shared VM."""
    from tandem.sim.cost.calibrated import shape_from_sample

    def level(steps: list[dict[str, Any]]) -> float:
        predicted = sum(cost.step_time_s(shape_from_sample(s)) for s in steps)
        return sum(s["seconds"] for s in steps) / predicted if predicted > 0 else 1.0

    return (level([s for s in samples if s["num_prefill_tokens"] > 0]),
            level([s for s in samples if s["num_prefill_tokens"] == 0]))


def calibrate(model: str | None = None, quick: bool = False, log: Log = print,
              seed: int = 0) -> dict[str, Any]:
    """Build the engine (default configuration) and return its simulator profile."""
    sched_cfg, cache_cfg = SchedulerConfig(), CacheConfig()
    engine = build_engine(ModelConfig(model=model, seed=seed), cache_cfg, sched_cfg, None, progress=False)
    return profile_engine(engine, resolve_model(model, False).name, quick=quick, log=log, seed=seed)


def profile_engine(engine: LLMEngine, model_name: str, quick: bool = False, log: Log = print,
                   seed: int = 0) -> dict[str, Any]:
    """Measure a built, idle engine (no speculation attached) and return a simulator profile (see
    tandem.sim.cost.calibrated). The engine is left as it was found, with its prefix cache reset."""
    if engine.has_unfinished_requests():
        raise ValueError("profile_engine needs an idle engine")
    runner = engine.executor
    cfg = runner.model.cfg
    elem = torch.empty((), dtype=runner.cache.dtype).element_size()
    t0 = time.perf_counter()
    try:
        with StepRecorder(engine) as recorder:
            measure(_Session(engine, recorder, random.Random(seed)), runner, quick, log)
    finally:
        engine.scheduler.reset_prefix_cache()
    samples = [s for s in recorder.samples if s["phase"] != "warmup"]
    decode_b1 = [s["seconds"] for s in samples if s["phase"] == "decode-1x64" and s["num_tokens"] == 1]
    kv, sched_cfg = engine.scheduler.kv, engine.scheduler.config
    return {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model_name,
        "dtype": str(runner.model.dtype).replace("torch.", ""),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "engine": {"block_size": kv.block_size, "num_kv_blocks": kv.num_blocks,
                   "num_host_blocks": kv.num_host_blocks,
                   "max_num_batched_tokens": sched_cfg.max_num_batched_tokens,
                   "max_num_seqs": sched_cfg.max_num_seqs,
                   "max_model_len": engine.max_model_len,
                   "kv_bytes_per_token": 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem},
        "copy_bytes_per_s": _copy_bytes_per_s(),
        "probe": {"decode_b1_ctx64_s": statistics.median(decode_b1) if decode_b1 else None},
        "calibration_wall_s": time.perf_counter() - t0,
        "fit": fit(samples), "samples": samples,
    }
