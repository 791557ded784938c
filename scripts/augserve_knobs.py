"""`tandem bench augmented` with AugServe's Stage II knobs set from the environment, for ablations:

    AGING=0.5   AugServeOrdering.aging (priority seconds per second waited; default 0)
    SHARE=1.0   AugServeOrdering.starving_share (1.0: every request past max_wait_s first)
    TOOLW=0     AugServeOrdering.tool_time_weight (weight of predicted tool time in service time)
    RECLAIM=0   SchedulingPolicy.reclaim_kept_kv for the augserve policies

    SHARE=1.0 python scripts/augserve_knobs.py bench augmented --policies augserve ... --json PATH
"""
import os, sys
from tandem.sched import ordering as O, policies as P
_init = O.AugServeOrdering.__init__
def _i(self, *a, **k):
    _init(self, *a, **k)
    if "AGING" in os.environ: self.aging = float(os.environ["AGING"])
    if "TOOLW" in os.environ: self.tool_time_weight = float(os.environ["TOOLW"])
    if "SHARE" in os.environ and hasattr(self, "starving_share"): self.starving_share = float(os.environ["SHARE"])
O.AugServeOrdering.__init__ = _i
if "RECLAIM" in os.environ:
    _mp = P.make_policy
    def mp(*a, **k):
        p = _mp(*a, **k)
        if hasattr(p, "reclaim_kept_kv") and p.name.startswith("augserve"): p.reclaim_kept_kv = os.environ["RECLAIM"] == "1"
        return p
    P.make_policy = mp
    import tandem.sched.scheduler as S; S.make_policy = mp
from tandem.cli import main
sys.argv = ["tandem"] + sys.argv[1:]
main()
