"""Tandem against other engines on this machine, one after the other: `tandem bench compare --peer
vllm|llamacpp`. vllm.py: vLLM's CPU build (offline, the bundled prompt set, served); llamacpp.py:
llama.cpp's llama-server (served); report.py: the tables. Served runs are judged by vLLM's own
`vllm bench serve` from the vLLM peer's environment, for either peer.

Nothing here imports vLLM: each peer runs as its own processes under its own interpreter.

Two things come from a source checkout (ROOT, the folder holding pyproject.toml and scripts/; None
when Tandem is installed from a wheel):
- scripts/offline_run.py, which vLLM's interpreter runs by path for the offline and prompt-set
  parts. It stays out of this package: a script run by path has its folder first on sys.path, and
  this folder's vllm.py would then shadow vLLM itself.
- the default --out folders, ROOT/docs/results/compare_vllm/latest and .../compare_llamacpp/latest
  (one folder per comparison, one subfolder per run); outside a checkout --out must be given.
"""

from __future__ import annotations

import sys
from pathlib import Path


def source_root() -> Path | None:
    """The source checkout this package runs from (ROOT/src/tandem/bench/peers), or None."""
    root = Path(__file__).resolve().parents[4]
    return root if (root / "pyproject.toml").is_file() and (root / "scripts" / "offline_run.py").is_file() else None


ROOT = source_root()


def default_out(name: str) -> Path:
    """ROOT/docs/results/NAME, the comparison's default --out; a ValueError outside a checkout."""
    if ROOT is None:
        raise ValueError(f"--out is required: no source checkout to write docs/results/{name} into")
    return ROOT / "docs" / "results" / name


def tandem_bin() -> str:
    """The `tandem` whose server is compared: the checkout's .venv's where it has one (run from a
    frozen clone, the clone's), else the one beside this interpreter, else PATH's."""
    for p in ([ROOT / ".venv" / "bin" / "tandem"] if ROOT else []) + [Path(sys.executable).parent / "tandem"]:
        if p.exists():
            return str(p)
    return "tandem"
