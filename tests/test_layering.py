"""Architecture seams: the scheduler and the KV bookkeeping are plain Python (the simulator's path).

They must import and run with torch unavailable, and must not read a clock (time is passed in as `now`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tandem
from tests.doubles import run_without_torch

SRC = Path(tandem.__file__).resolve().parent
POLICY_DIRS = ("sched", "kv", "router")
FORBIDDEN = re.compile(
    r"^\s*(?:import\s+torch\b|from\s+torch\b|import\s+time\b|from\s+time\s+import\b)"
    r"|\btime\.(?:time|monotonic|perf_counter)\(",
    re.MULTILINE,
)

NO_TORCH_SCRIPT = """

    import tandem.kv
    import tandem.sched
    import tandem.sched.scheduler
    from tandem.config import SchedulerConfig
    from tandem.sampling_params import SamplingParams
    from tandem.types import Request, StepResult

    kv = tandem.kv.KVCacheManager(num_blocks=8, block_size=4)
    sched = tandem.sched.Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=32), kv)
    sched.add_request(Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True)))
    now = 0.0
    while sched.has_unfinished():
        plan = sched.schedule(now)
        result = StepResult({s.request_id: [7] for s in plan.seqs if s.sample})
        sched.update(plan, result, now)
        now += 1.0
    assert kv.num_free_blocks == kv.num_blocks
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers") and sys.modules[m] is not None)
    assert not heavy, heavy
    print("ok", sched.num_steps)
"""


def policy_files() -> list[Path]:
    return sorted(p for d in POLICY_DIRS for p in (SRC / d).rglob("*.py"))


def test_sched_and_kv_import_and_run_without_torch():
    """tandem.sched / tandem.kv import and a schedule/update loop runs when torch cannot be imported."""
    proc = run_without_torch(NO_TORCH_SCRIPT, timeout=60, cwd=SRC.parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "3"]      # one prefill step, then two decode steps


def test_forbidden_pattern_detects_violations():
    """The static check's regex is not vacuous: it catches every form it is meant to."""
    bad = ["import torch", "from torch import nn", "import time", "from time import monotonic",
           "    import torch.nn as nn", "t = time.time()", "t = time.monotonic()", "t = time.perf_counter()"]
    for line in bad:
        assert FORBIDDEN.search(line), line
    ok = ["import timeit", "from tandem.types import RequestTimes", "now: float  # time is passed in",
          "request.times.first_token = now", "import torchvision"]
    for line in ok:
        assert not FORBIDDEN.search(line), line


def test_policy_package_files_exist():
    names = {p.relative_to(SRC).as_posix() for p in policy_files()}
    assert {"sched/scheduler.py", "kv/manager.py", "kv/block_pool.py"} <= names


@pytest.mark.parametrize("path", policy_files(), ids=lambda p: p.relative_to(SRC).as_posix())
def test_policy_code_uses_no_torch_and_no_clock(path):
    """No file under tandem/sched or tandem/kv imports torch or reads the wall clock."""
    hits = [m.group(0).strip() for m in FORBIDDEN.finditer(path.read_text())]
    assert not hits, f"{path.name}: {hits}"


NO_RAY = re.compile(r"^\s*(?:import\s+ray\b|from\s+ray\b)", re.MULTILINE)


@pytest.mark.parametrize("path", sorted((SRC / "router").rglob("*.py")), ids=lambda p: p.relative_to(SRC).as_posix())
def test_router_is_pure(path):
    """The routing policy (shared by the simulator and the Ray Serve router) imports neither ray nor torch."""
    assert not NO_RAY.findall(path.read_text()), path.name
    assert "tandem.sim" not in path.read_text() and "tandem.cluster" not in path.read_text(), path.name
