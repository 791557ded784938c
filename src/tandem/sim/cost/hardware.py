"""Accelerator presets for the analytic (roofline) cost model.

Peak figures are the vendors' published datasheet numbers (dense bf16 tensor-core FLOP/s, without
sparsity; HBM bandwidth; memory; NVLink; PCIe to the host). The efficiency factors are this
project's assumptions, chosen from what serving engines commonly achieve and stated here so that
results can be read (and changed) with them in view:

- `compute_efficiency` 0.55: fraction of peak FLOP/s that large prefill / verification GEMMs reach
  in a serving step (vLLM-class engines report 40-65% MFU on prefill-heavy steps);
- `memory_efficiency` 0.75: fraction of HBM bandwidth that decode steps reach (weight + KV reads);
- `step_overhead_s` 2 ms: per target step (scheduling, input preparation, sampling, launches with
  CUDA graphs) and `seq_overhead_s` 10 us per scheduled sequence;
- `draft_overhead_s` 0.3 ms per draft-model forward (one per draft position);
- `host_link_efficiency` 0.8 of the PCIe link for KV swaps (pinned host memory, large copies);
- `tp_efficiency` 0.9: with N GPUs in tensor parallel, aggregate FLOP/s and bandwidth are
  N x peak x 0.9, plus two all-reduces per layer over NVLink (`allreduce_latency_s` 8 us each).
Owns hardware facts only; knows nothing of models or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float              # dense bf16 FLOP/s
    memory_bandwidth: float        # HBM bytes/s
    memory_bytes: float
    host_link_bandwidth: float     # PCIe bytes/s per direction (KV swap to host memory)
    nvlink_bandwidth: float        # bytes/s per GPU (tensor-parallel all-reduce)
    compute_efficiency: float = 0.55
    memory_efficiency: float = 0.75
    step_overhead_s: float = 2e-3
    seq_overhead_s: float = 1e-5
    draft_overhead_s: float = 3e-4
    host_link_efficiency: float = 0.8
    tp_efficiency: float = 0.9
    allreduce_latency_s: float = 8e-6


GB = 1e9
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    # A100 SXM4 80GB: 312 TFLOP/s bf16 dense, 2.039 TB/s HBM2e, PCIe Gen4 x16 (32 GB/s), NVLink 3 600 GB/s.
    Hardware("A100-80GB", 312e12, 2039 * GB, 80 * 2**30, 32 * GB, 600 * GB),
    # H100 SXM5 80GB: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, PCIe Gen5 x16 (64 GB/s), NVLink 4 900 GB/s.
    Hardware("H100-80GB", 989e12, 3350 * GB, 80 * 2**30, 64 * GB, 900 * GB),
    # H200 SXM 141GB: the H100's compute, 4.8 TB/s HBM3e, 141 GB.
    Hardware("H200", 989e12, 4800 * GB, 141 * GB, 64 * GB, 900 * GB),
)}


def get_hardware(name: str, **overrides: float) -> Hardware:
    """A preset by name (case-insensitive), with any field overridden."""
    for key, hw in HARDWARE.items():
        if key.lower() == name.lower() or key.lower().split("-")[0] == name.lower():
            return replace(hw, **overrides) if overrides else hw
    raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}")
