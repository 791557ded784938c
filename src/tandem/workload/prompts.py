"""Prompt sets: the project's shared prompt set (bundled), and user JSONL files of the same shape.

Each record: {"kind": str, "messages": [...], "max_tokens": int}. The bundled copy comes from the
project's shared/workloads/prompts.jsonl (36 prompts: chat, rewrite, extract, code).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass(frozen=True)
class PromptItem:
    kind: str
    messages: list[dict]
    max_tokens: int


def load_prompt_set(path: str | Path | None = None) -> list[PromptItem]:
    if path is None:
        text = resources.files("tandem.workload").joinpath("data/prompts.jsonl").read_text()
    else:
        text = Path(path).read_text()
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            items.append(PromptItem(d.get("kind", "chat"), d["messages"], int(d.get("max_tokens", 128))))
        except (ValueError, KeyError) as e:
            raise ValueError(f"{path or 'prompts.jsonl'}:{n}: not a prompt record ({e})") from e
    return items
