"""The one factory for a scheduler and its speculation side, from configs.

The engine (`tandem.llm.build_engine`), the simulator (`tandem.sim.build`) and the benchmarks all
build their scheduler here, so the three run the same wiring. Everything goes in through
constructors; a benchmark that switches draft-length policy on a loaded engine builds a new
`Speculation` here and hands it to `Scheduler.reconfigure_speculation` (through
`tandem.llm.reconfigure_speculation`, which also swaps the runner's side). Torch-free and clock-free.
"""

from __future__ import annotations

from tandem.config import SchedulerConfig, SpecConfig
from tandem.kv import KVCacheManager
from tandem.sched.cost_model import StepCostModel
from tandem.sched.frontiers import make_frontier_chooser
from tandem.sched.policies import make_policy
from tandem.sched.scheduler import Scheduler, Speculation
from tandem.sched.spec_length import AcceptanceModel, make_length_policy


def make_speculation(cfg: SpecConfig | None, cost: StepCostModel) -> Speculation | None:
    """What a `SpecConfig` asks of the scheduler (None: no speculation). The policies read `cost`,
    the scheduler's step-cost model, which the scheduler trains."""
    if cfg is None:
        return None
    length = make_length_policy(cfg, cost)
    acceptance = getattr(length, "acceptance", None)      # one owner: the frontier chooser reads it
    return Speculation(length, 0 if cfg.policy == "none" else cfg.max_draft_tokens,
                       make_frontier_chooser(cfg, cost, acceptance if isinstance(acceptance, AcceptanceModel) else None))


def build_scheduler(config: SchedulerConfig, kv: KVCacheManager, cost: StepCostModel,
                    spec: SpecConfig | None = None, swap_s_per_token: float = 5e-6,
                    trained: dict | None = None) -> Scheduler:
    """A scheduler over `kv` running `config.policy` (with its predictor state `trained`, if any:
    see `make_policy`) and the speculation `spec` asks for; `cost` is its step-cost model."""
    policy = make_policy(config.policy, config.max_num_batched_tokens, cost, swap_s_per_token=swap_s_per_token,
                         trained=trained)
    return Scheduler(config, kv, policy, speculation=make_speculation(spec, cost), cost=cost,
                     swap_s_per_token=swap_s_per_token)
