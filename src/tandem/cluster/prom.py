"""/metrics of a cluster: every replica's Prometheus text, each sample given a `replica` label,
merged so that each metric family appears once (its HELP and TYPE, then all replicas' samples,
as the text format requires)."""

from __future__ import annotations

import re

_NAME = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{)?")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def label_sample(line: str, label: str, value: str) -> str:
    """`name{a="b"} 1` -> `name{replica="r",a="b"} 1`; `name 1` -> `name{replica="r"} 1`."""
    m = _NAME.match(line)
    if m is None:
        return line
    pair = f'{label}="{_escape(value)}"'
    name = m.group(1)
    if m.group(2):
        rest = line[m.end():]
        return f"{name}{{{pair}{'' if rest.startswith('}') else ','}{rest}"
    return f"{name}{{{pair}}}{line[m.end():]}"


def merge_metrics(texts: dict[str, str], label: str = "replica") -> str:
    """Merge {replica id: its /metrics text} into one exposition."""
    families: dict[str, list[str]] = {}          # family name -> HELP/TYPE lines
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    head = families.setdefault(family, [])
                    if line not in head:
                        head.append(line)
                    samples.setdefault(family, [])
                continue
            samples.setdefault(family, []).append(label_sample(line, label, replica))
            families.setdefault(family, [])
    out = []
    for family, head in families.items():
        out.extend(head)
        out.extend(samples.get(family, []))
    return "\n".join(out) + "\n"
