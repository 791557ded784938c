"""Wiring of a simulated deployment: the scheduler comes from the same factory the real engine's
does (`tandem.sched.build.build_scheduler`), over a KVCacheManager sized by a cost model's
`Deployment` instead of a loaded model.

One difference, stated: the scheduler's online step-cost model starts from points of the
simulated cost model (what a calibrated deployment would load) rather than from its CPU-shaped
prior, so that AugServe's service-time estimates and the draft-length policies are sensible from
the first step on every simulated machine; it keeps learning from the (virtual) step durations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.config import SchedulerConfig, SpecConfig
from tandem.kv import BlockPool, KVCacheManager
from tandem.sched import build as sched_build
from tandem.sched.cost_model import StepCostModel
from tandem.sched.scheduler import Scheduler
from tandem.sim.cost.base import CostModel, Deployment, StepShape

TOOL_TIME_HINTS = ("oracle", "predicted")


@dataclass(frozen=True)
class SimConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    seed: int = 0
    position_decay: float = 0.97        # draft m is accepted with probability base * decay^(m-1)
    # What the scheduler is told about a tool call's duration when it pauses: "oracle" passes the
    # trace's api_time (the engine's scripted mode does this), "predicted" passes nothing, so the
    # scheduler uses its per-tool moving average (the engine's mode for real tools).
    tool_time_hint: str = "oracle"
    seed_step_cost: bool = True
    predictor: dict | None = None       # trained predictor state the policies start from (make_policy)
    step_jitter: tuple[float, float] = (0.0, 1.0)   # (p, x): a step takes x times as long with probability p

    def __post_init__(self) -> None:
        if self.tool_time_hint not in TOOL_TIME_HINTS:
            raise ValueError(f"tool_time_hint must be one of {TOOL_TIME_HINTS}, got {self.tool_time_hint!r}")


def typical_shape(num_tokens: int, max_num_seqs: int, context_tokens: int = 512) -> StepShape:
    """A step of `num_tokens`: up to `max_num_seqs` decodes at `context_tokens`, the rest one chunk."""
    decodes = min(num_tokens, max_num_seqs)
    chunk = num_tokens - decodes
    seqs = decodes + (1 if chunk else 0)
    ctx = decodes * context_tokens + chunk
    pairs = decodes * context_tokens + chunk * (chunk + 1) // 2
    return StepShape(seqs, num_tokens, seqs, chunk, ctx, pairs)


def seeded_step_cost(cost: CostModel, cfg: SchedulerConfig) -> StepCostModel:
    """The scheduler's StepCostModel, starting from the cost model's typical steps."""
    top = max(2, cfg.max_num_batched_tokens)
    sizes = sorted({1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, top // 2, top} - {0})
    points = [(n, cost.step_time_s(typical_shape(n, cfg.max_num_seqs))) for n in sizes if n <= top]
    t1, t_top = points[0][1], points[-1][1]
    t_half = cost.step_time_s(typical_shape(top // 2, cfg.max_num_seqs))
    per_token = max(1e-7, (t_top - t_half) / max(1, top - top // 2))
    return StepCostModel(base_s=max(1e-6, t1 - per_token), per_token_s=per_token, profile=points)


def build_scheduler(cfg: SimConfig, cost: CostModel, deployment: Deployment | None = None,
                    pool_factory: Callable[[int], BlockPool] | None = None) -> Scheduler:
    """The deployment's scheduler over a KV manager it sizes; `pool_factory(num_blocks)`: the
    manager's block pool (the simulated cluster's replicas keep a prefix digest in theirs)."""
    dep = deployment or cost.deployment()
    if getattr(cost, "block_size", cfg.block_size) != cfg.block_size:
        raise ValueError(f"the cost model is sized for KV blocks of {cost.block_size} tokens, "
                         f"not {cfg.block_size}")
    kv = KVCacheManager(dep.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching,
                        num_host_blocks=dep.num_host_blocks,
                        pool=pool_factory(dep.num_kv_blocks) if pool_factory else None)
    step_cost = seeded_step_cost(cost, cfg.scheduler) if cfg.seed_step_cost else StepCostModel()
    return sched_build.build_scheduler(cfg.scheduler, kv, step_cost, cfg.spec, swap_s_per_token=dep.swap_s_per_token,
                                       trained=cfg.predictor)
