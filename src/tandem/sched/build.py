"""The one factory for a scheduler and its speculation side, from configs.

The engine (`tandem.llm.build_engine`), the simulator (`tandem.sim.build`) and the benchmarks all
build their scheduler here, so the three run the same wiring. Everything goes in through
constructors; a benchmark that switches draft-length policy on a loaded engine builds a new
`Speculation` (tandem.sched.drafts) and hands it to `Scheduler.reconfigure_speculation` (through
`tandem.llm.reconfigure_speculation`, which also swaps the runner's side). Torch-free and clock-free.
"""

from __future__ import annotations

from tandem.config import SchedulerConfig, SpecConfig
from tandem.kv import KVCacheManager
from tandem.sched.cost_model import StepCostModel
from tandem.sched.policies import make_policy
from tandem.sched.scheduler import Scheduler
from tandem.sched.drafts import make_speculation


def build_scheduler(config: SchedulerConfig, kv: KVCacheManager, cost: StepCostModel,
                    spec: SpecConfig | None = None, swap_s_per_token: float = 5e-6,
                    trained: dict | None = None) -> Scheduler:
    """A scheduler over `kv` running `config.policy` (with its predictor state `trained`, if any:
    see `make_policy`) and the speculation `spec` asks for; `cost` is its step-cost model."""
    policy = make_policy(config.policy, config.max_num_batched_tokens, cost, swap_s_per_token=swap_s_per_token,
                         trained=trained)
    return Scheduler(config, kv, policy, speculation=make_speculation(spec, cost), cost=cost,
                     swap_s_per_token=swap_s_per_token)
