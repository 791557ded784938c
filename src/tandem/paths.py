"""Where Tandem keeps what it makes: `$TANDEM_CACHE` (default `~/.cache/tandem`) holds converted
models (tandem.models.fetch), built CPU kernels (tandem.runner.kernels) and datasets (tandem.workload.fetch)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
