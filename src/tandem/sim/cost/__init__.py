"""Cost models for the simulator, behind one interface (`CostModel`, see base.py):

- `CalibratedCost`: fitted to steps of this engine measured on this machine (`tandem simulate calibrate`);
- `RooflineCost`: analytic, from a model's shape and an accelerator preset (A100-80GB, H100-80GB, H200).
"""

from __future__ import annotations

from tandem.sim.cost.base import CostModel, Deployment, StepShape, shape_of
from tandem.sim.cost.calibrated import CalibratedCost, load_profile
from tandem.sim.cost.hardware import HARDWARE, Hardware, get_hardware
from tandem.sim.cost.models import MODELS, ModelArch, get_model
from tandem.sim.cost.roofline import RooflineCost

__all__ = ["CostModel", "Deployment", "StepShape", "shape_of", "CalibratedCost", "load_profile", "HARDWARE",
           "Hardware", "get_hardware", "MODELS", "ModelArch", "get_model", "RooflineCost", "make_cost_model"]


def make_cost_model(hardware: str, model: str | dict | None = None, draft: str | dict | None = None,
                    num_gpus: int = 1, block_size: int = 16, gpu_memory_utilization: float = 0.9,
                    swap_space_gb: float = 32.0) -> CostModel:
    """`hardware` is a preset name (with `model`, and `draft` for a separate draft model), or
    "calibrated" / "calibrated:PATH" for a measured profile (the committed one by default)."""
    if hardware.startswith("calibrated"):
        path = hardware.partition(":")[2] or None
        return CalibratedCost(load_profile(path))
    if model is None:
        raise ValueError(f"hardware {hardware!r} needs a model")
    draft_arch = get_model(draft) if draft else None
    return RooflineCost(get_model(model), get_hardware(hardware), num_gpus, draft_arch, block_size,
                        gpu_memory_utilization, swap_space_gb)
