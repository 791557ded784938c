"""Datasets as lists of work items: the bundled prompt set, ShareGPT, HumanEval, augmented traces, user files.

One entry point, `load_dataset(name_or_path, n, seed, count_tokens)`. Owns the parsing and the
sampling rules; the download and cache live in fetch.py, the tool-call traces in augmented.py.

- ShareGPT (vLLM's serving-benchmark sampling): the first human turn is the prompt, the reply's
  token count is the expected output length; pairs with a prompt or reply under 4 tokens, a prompt
  over 1024 or prompt + reply over 2048 tokens are dropped. The packaged file is cut short (not
  valid JSON as a whole), so it is read record by record and the truncated tail is ignored.
- HumanEval: the function's signature and docstring; the chat form asks the model to complete it.
  `humaneval-edit` shows the whole function (its canonical solution included) and asks for it
  back with comments and type hints: outputs copy the input (speculation's best case on real
  code). `humaneval-tools` is a multi-turn agent transcript over the problems' own functions:
  earlier assistant turns are JSON tool calls (read, test, edit the function), and the model is
  asked for the next call in the same form: outputs repeat earlier outputs.
- Files: `.json` holding a ShareGPT-shaped list, or JSONL (optionally `.gz`) whose records have
  `messages` (the prompt-set shape), `prompt` (text), `conversations` (ShareGPT) or `task_id` +
  `prompt` (HumanEval); `max_tokens` (or `output_len`) sets the expected output length.

Selection: `n=None` gives every item in file order; otherwise a `random.Random(seed)` shuffle, cycled
(reshuffled each pass) when `n` exceeds what the dataset holds. No torch, no clock.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from tandem.workload import fetch
from tandem.workload.augmented import (AugmentedRequest, is_trace, load_profiles, parse_trace,
                                      sample_augmented, synthetic_text)
from tandem.workload.prompts import load_prompt_set

TokenCounter = Callable[[str], int]
NAMES = ("prompts", "sharegpt", "humaneval", "humaneval-edit", "humaneval-tools", "augmented")
MIN_TOKENS, MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS = 4, 1024, 2048
HUMANEVAL_MAX_TOKENS = 256
HUMANEVAL_EDIT_MAX_TOKENS = 512
DEFAULT_MAX_TOKENS = 128
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_SEPARATORS = re.compile(r"[\s,]*")


@dataclass(frozen=True)
class WorkItem:
    """One request to send: chat messages and the same prompt as plain text (for /v1/completions)."""
    kind: str                       # "chat", "code", "sharegpt", "humaneval", an augmentation type, ...
    messages: list[dict[str, Any]]
    prompt: str
    max_tokens: int                 # expected output length: the cap sent with the request
    source: str                     # dataset name or file path
    prompt_tokens: int | None = None
    augmented: AugmentedRequest | None = field(default=None)


def estimate_tokens(text: str) -> int:
    """Cheap token-count estimate: words plus punctuation marks (close to BPE counts for English and code)."""
    return len(_TOKEN_RE.findall(text))


def load_dataset(name_or_path: str, n: int | None = None, seed: int = 0,
                 count_tokens: TokenCounter | None = None) -> list[WorkItem]:
    """`n` work items of a named dataset (prompts, sharegpt, humaneval, augmented[:TYPE]) or a file."""
    count = count_tokens or estimate_tokens
    rng = random.Random(seed)
    name = name_or_path.lower()
    if name == "prompts":
        return select(prompt_set_items(None), n, rng)
    if name == "sharegpt":
        return sample_sharegpt(iter_sharegpt(read_text(fetch.fetch(fetch.SHAREGPT))), n, rng, count,
                               "sharegpt")
    if name == "humaneval":
        return select(humaneval_items(fetch.fetch(fetch.HUMANEVAL)), n, rng)
    if name == "humaneval-edit":
        return select([humaneval_edit_item(r, count) for r in _read_jsonl(fetch.fetch(fetch.HUMANEVAL))], n, rng)
    if name == "humaneval-tools":
        records = _read_jsonl(fetch.fetch(fetch.HUMANEVAL))
        return select([humaneval_tools_item(r, i, random.Random(i)) for i, r in enumerate(records)], n, rng)
    if name == "augmented" or name.startswith("augmented:"):
        kind = name.partition(":")[2] or "mixture"
        return augmented_items(sample_augmented(n or 100, rng, kind, load_profiles()), rng)
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ValueError(f"unknown dataset {name_or_path!r}: give one of {', '.join(NAMES)} or a file path")
    return load_file(path, n, rng, count)


def select(items: list[WorkItem], n: int | None, rng: random.Random) -> list[WorkItem]:
    """All items in order (n None), or n of them shuffled, cycling through reshuffles if n > len(items)."""
    if n is None:
        return list(items)
    if not items:
        raise ValueError("the dataset holds no usable items")
    out: list[WorkItem] = []
    while len(out) < n:
        batch = list(items)
        rng.shuffle(batch)
        out.extend(batch[: n - len(out)])
    return out


# ---- ShareGPT ---------------------------------------------------------------------------------

def iter_json_array(text: str) -> Iterator[Any]:
    """Elements of a JSON array one by one; stops quietly at a truncated final element."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        return
    i = start + 1
    while True:
        i = _SEPARATORS.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")  # a cut-short file may split a character


def iter_sharegpt(text: str) -> Iterator[tuple[str, str]]:
    """(first human turn, the reply to it) of every complete conversation in ShareGPT JSON text."""
    for record in iter_json_array(text):
        pair = sharegpt_pair(record)
        if pair is not None:
            yield pair


def sharegpt_pair(record: Any) -> tuple[str, str] | None:
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    for a, b in zip(turns, turns[1:]):
        if a.get("from") in ("human", "user") and b.get("from") not in ("human", "user", "system"):
            prompt, reply = a.get("value"), b.get("value")
            if isinstance(prompt, str) and isinstance(reply, str) and prompt and reply:
                return prompt, reply
            return None
    return None


def sharegpt_valid(prompt_tokens: int, output_tokens: int) -> bool:
    return (prompt_tokens >= MIN_TOKENS and output_tokens >= MIN_TOKENS and prompt_tokens <= MAX_PROMPT_TOKENS
            and prompt_tokens + output_tokens <= MAX_TOTAL_TOKENS)


def sample_sharegpt(pairs: Iterable[tuple[str, str]], n: int | None, rng: random.Random,
                    count: TokenCounter, source: str) -> list[WorkItem]:
    """vLLM's sampling: shuffle, then keep valid pairs until n (counting tokens only as far as needed)."""
    pairs = list(pairs)
    if n is not None:
        rng.shuffle(pairs)
    kept: list[WorkItem] = []
    for prompt, reply in pairs:
        if n is not None and len(kept) == n:
            return kept
        p_tokens, o_tokens = count(prompt), count(reply)
        if sharegpt_valid(p_tokens, o_tokens):
            kept.append(WorkItem("sharegpt", [{"role": "user", "content": prompt}], prompt, o_tokens, source,
                                 p_tokens))
    return kept if n is None else select(kept, n, rng)


# ---- HumanEval, prompt sets, augmented ----------------------------------------------------------

def humaneval_item(record: dict[str, Any], source: str) -> WorkItem:
    code = record["prompt"]
    ask = f"Complete the following Python function. Reply with the code only.\n\n```python\n{code}```"
    return WorkItem("humaneval", [{"role": "user", "content": ask}], code,
                    int(record.get("max_tokens", HUMANEVAL_MAX_TOKENS)), source)


def humaneval_edit_item(record: dict[str, Any], count: TokenCounter) -> WorkItem:
    code = record["prompt"] + record["canonical_solution"]
    ask = ("Rewrite the following Python function with type hints and a short comment above each "
           f"statement. Keep everything else as it is. Reply with the code only.\n\n```python\n{code}```")
    return WorkItem("humaneval-edit", [{"role": "user", "content": ask}], code,
                    min(count(code) * 3 // 2 + 32, HUMANEVAL_EDIT_MAX_TOKENS), "humaneval-edit")


_TOOL_STEPS = ("read_file", "run_tests", "edit_file", "run_tests")


def humaneval_tools_item(record: dict[str, Any], index: int, rng: random.Random) -> WorkItem:
    """An agent's transcript on one problem: 2-5 earlier tool calls (JSON) with their results, then
    a request for the next call."""
    fn, path = record["entry_point"], f"src/problem_{index}.py"
    first_line = record["canonical_solution"].strip().splitlines()[0].strip()
    messages: list[dict[str, Any]] = [{"role": "system", "content":
        'You are a coding agent. Reply with exactly one tool call as JSON: {"name": ..., "arguments": {...}}. '
        "Tools: read_file(path), run_tests(path, test), edit_file(path, function, old, new)."},
        {"role": "user", "content": f"Fix the failing tests of `{fn}` in {path}."}]
    def call(t: int) -> str:
        step = _TOOL_STEPS[t % len(_TOOL_STEPS)]
        args: dict[str, Any] = {"path": path}
        if step == "run_tests":
            args["test"] = f"tests/test_problem_{index}.py::test_{fn}"
        elif step == "edit_file":
            args |= {"function": fn, "old": first_line, "new": first_line}
        return json.dumps({"name": step, "arguments": args})

    turns = rng.randint(2, 5)
    for t in range(turns):
        step = _TOOL_STEPS[t % len(_TOOL_STEPS)]
        messages.append({"role": "assistant", "content": call(t)})
        result = (record["prompt"] if step == "read_file" else
                  f"1 failed: test_{fn} (assertion at line {rng.randint(3, 40)})" if step == "run_tests" else
                  "edited")
        messages.append({"role": "user", "content": f"Tool result:\n{result}\nNext call?"})
    # The expected output: the next call, with room to spare
    return WorkItem("humaneval-tools", messages, _messages_text(messages), 2 * estimate_tokens(call(turns)) + 16,
                    "humaneval-tools")


def humaneval_items(path: Path) -> list[WorkItem]:
    return [humaneval_item(r, "humaneval") for r in _read_jsonl(path)]


def prompt_set_items(path: Path | None) -> list[WorkItem]:
    source = str(path) if path else "prompts"
    return [WorkItem(p.kind, p.messages, _messages_text(p.messages), p.max_tokens, source)
            for p in load_prompt_set(path)]


def augmented_items(requests: list[AugmentedRequest], rng: random.Random,
                    source: str = "augmented") -> list[WorkItem]:
    """Work items carrying their tool-call trace; the prompt is filler text of the trace's prompt length."""
    items = []
    for req in requests:
        text = synthetic_text(req.prompt_tokens, rng)
        items.append(WorkItem(req.type, [{"role": "user", "content": text}], text, req.output_tokens, source,
                              req.prompt_tokens, req))
    return items


# ---- user files -------------------------------------------------------------------------------

def load_file(path: Path, n: int | None, rng: random.Random, count: TokenCounter) -> list[WorkItem]:
    if path.suffix == ".json":
        text = read_text(path)
        first = json.loads(text) if text.lstrip().startswith("{") else next(iter_json_array(text), None)
        if is_trace(first):
            return select(augmented_items(parse_trace(json.loads(text)), rng, str(path)), n, rng)
        return sample_sharegpt(iter_sharegpt(text), n, rng, count, str(path))
    records = list(_read_jsonl(path))
    if records and "conversations" in records[0]:
        pairs = [p for p in map(sharegpt_pair, records) if p is not None]
        return sample_sharegpt(pairs, n, rng, count, str(path))
    return select([record_item(r, str(path), i) for i, r in enumerate(records, 1)], n, rng)


def record_item(record: dict[str, Any], source: str, line: int) -> WorkItem:
    """A work item from one JSONL record (prompt-set, HumanEval or plain-prompt shape)."""
    max_tokens = int(record.get("max_tokens", record.get("output_len", DEFAULT_MAX_TOKENS)))
    if "task_id" in record and "prompt" in record:
        return humaneval_item(record, source)
    if isinstance(record.get("messages"), list):
        msgs = record["messages"]
        return WorkItem(record.get("kind", "chat"), msgs, _messages_text(msgs), max_tokens, source)
    if isinstance(record.get("prompt"), str):
        text = record["prompt"]
        msgs = [{"role": "user", "content": text}]
        return WorkItem(record.get("kind", "text"), msgs, text, max_tokens, source)
    raise ValueError(f"{source}:{line}: a record needs `messages`, `prompt` or `conversations`")


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON ({e})") from e


def _messages_text(messages: list[dict[str, Any]]) -> str:
    return "\n\n".join(str(m.get("content", "")) for m in messages)
