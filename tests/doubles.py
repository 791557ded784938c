"""Honest test doubles shared by tests: a canned model executor; a Python with torch blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tandem.types import StepPlan, StepResult

_BLOCK_TORCH = """
import importlib.abc, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, _Block())
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the import blocker does not work")
"""


def run_without_torch(script: str, timeout: float = 60, cwd=None) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter where importing torch or transformers fails."""
    code = _BLOCK_TORCH + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=cwd)


class CannedModel:
    """Executor double: a request emits given tokens in order, one per sampled step (then `fill`).

    `queue[request_id]` holds a request's tokens; a request seen for the first time gets a copy of
    `default` (for requests whose ids are made elsewhere, e.g. by the HTTP server)."""

    def __init__(self, default: list[int] | None = None, fill: int = 0) -> None:
        self.queue: dict[str, list[int]] = {}
        self.default = default or []
        self.fill = fill

    def execute(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        for s in plan.seqs:
            if s.sample:
                q = self.queue.setdefault(s.request_id, list(self.default))
                result.sampled_token_ids[s.request_id] = [q.pop(0) if q else self.fill]
        return result

    def release(self, request_ids):
        for rid in request_ids:
            self.queue.pop(rid, None)
