"""The model's sampling defaults, from its generation_config.json (vLLM's `--generation-config`).

`source` "auto" (the default) reads the model directory's generation_config.json; "vllm" ignores
it (Tandem's neutral defaults: temperature 1, top_p 1, no top_k, min_p or penalties); any other
value is a folder holding a generation_config.json. The fields vLLM takes from it, when set, become
the defaults of a request that omits them: temperature, top_p, top_k, min_p, repetition_penalty,
presence_penalty, frequency_penalty, and max_new_tokens as the default max_tokens. A request's own
value always wins. `do_sample` is ignored, as vLLM does (a config with do_sample false and a
temperature still samples at that temperature; a request asks for greedy with temperature 0).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.errors import ConfigError, InvalidRequestError, ModelLoadError

FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p", "min_p",
          "max_new_tokens")
SOURCES_HELP = "auto (the model's generation_config.json), vllm (ignore it) or a folder holding one"


def generation_defaults(source: str, model_dir: Path) -> dict[str, Any]:
    """SamplingParams keyword defaults from `source` (see the module docstring); {} for none."""
    from tandem.sampling_params import SamplingParams

    if source == "vllm":
        return {}
    if source == "auto":
        path = model_dir / "generation_config.json"
        if not path.is_file():
            return {}
    else:
        folder = Path(source).expanduser()
        path = folder / "generation_config.json"
        if not path.is_file():
            what = "has no generation_config.json" if folder.is_dir() else "is not a folder"
            raise ConfigError(f"generation_config {source!r} {what} (give {SOURCES_HELP})")
    try:
        raw = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = raw.get(name)
        if value is None or isinstance(value, bool):
            continue
        if name in ("max_new_tokens", "top_k") and isinstance(value, float) and value.is_integer():
            value = int(value)
        if name == "max_new_tokens":
            out["max_tokens"] = value
        elif name == "top_k":
            out["top_k"] = -1 if value in (0, -1) else value     # Hugging Face's 0 (and vLLM's -1): off
        else:
            out[name] = value
    try:
        SamplingParams(**out)
    except (InvalidRequestError, TypeError) as e:
        raise ModelLoadError(f"{path}: {e} (give --generation-config vllm to ignore the file)") from e
    return out


def default_sampling_params(defaults: dict[str, Any]):
    """The SamplingParams a caller that gives none gets (vLLM's LLM.get_default_sampling_params)."""
    from tandem.sampling_params import SamplingParams

    return SamplingParams(**defaults)
