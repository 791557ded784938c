"""Helpers shared by benchmarks: machine facts, percentiles, JSON output."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path
from typing import Any

from tandem.sim.metrics import percentile  # noqa: F401  (re-exported: one definition for benchmarks and simulator)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def memory_bandwidth_gbs(mb: int = 256, repeats: int = 5) -> float:
    """Read bandwidth of this machine (a large tensor sum), median of `repeats`: the roofline's denominator."""
    import torch

    x = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def matmul_tflops(n: int = 1536, repeats: int = 5, dtype=None) -> float:
    """Dense matmul throughput of this machine in the model's dtype: the compute roofline's denominator."""
    import torch

    dtype = dtype or torch.float32
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e12


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    from tandem.runner.device import cpu_info

    return cpu_info().get("model name") or platform.processor() or platform.machine()


def simd_flags() -> list[str]:
    """The vector-instruction flags that decide kernels and dtype (figures differ between them)."""
    from tandem.runner.device import cpu_info

    flags = set(cpu_info().get("flags", "").split())
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
    return [f for f in wanted if f in flags]


def machine_info() -> dict[str, Any]:
    import torch

    from tandem.runner.device import cpu_has_fast_bf16

    return {"cpu": cpu_model(), "cpu_flags": simd_flags(), "cores": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "fast_bf16": cpu_has_fast_bf16()}


def write_json(path: str | Path | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, default=str))
