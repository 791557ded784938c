"""Workloads: arrival processes, augmented traces, dataset parsing; and the no-torch, no-clock seam.

Nothing here downloads: datasets are parsed from small synthetic files written to tmp_path (the
named datasets read them from a temporary $TANDEM_CACHE).
"""

from __future__ import annotations

import gzip
import json
import math
import random
import re
import statistics
from pathlib import Path

import pytest

import tandem
from tests.doubles import run_without_torch
from tandem.workload import arrivals as arr
from tandem.workload import augmented as aug
from tandem.workload.datasets import estimate_tokens, iter_json_array, load_dataset

WORKLOAD = Path(tandem.__file__).resolve().parent / "workload"


# ---- arrivals ---------------------------------------------------------------------------------

def test_arrivals_are_deterministic_under_a_seed():
    for make in (lambda r: arr.poisson_arrivals(5.0, r, n=200),
                 lambda r: arr.gamma_arrivals(5.0, r, cv=2.0, n=200),
                 lambda r: arr.diurnal_arrivals(arr.DiurnalProfile(5.0, 20.0, 30.0), r, n=200)):
        assert make(random.Random(7)) == make(random.Random(7))
        assert make(random.Random(7)) != make(random.Random(8))


def test_poisson_mean_rate_and_bounds():
    times = arr.poisson_arrivals(20.0, random.Random(0), n=20000)
    assert times == sorted(times) and len(times) == 20000
    assert len(times) / times[-1] == pytest.approx(20.0, rel=0.03)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)
    within = arr.poisson_arrivals(20.0, random.Random(0), duration_s=10.0)
    assert within[-1] <= 10.0 and len(within) == pytest.approx(200, rel=0.25)
    assert arr.poisson_arrivals(float("inf"), random.Random(0), n=3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arr.poisson_arrivals(1.0, random.Random(0))


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_rate_and_cv(cv):
    times = arr.gamma_arrivals(10.0, random.Random(1), cv=cv, n=20000)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert len(times) / times[-1] == pytest.approx(10.0, rel=0.06)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.1)


def test_diurnal_peak_valley_ratio():
    profile = arr.DiurnalProfile(mean_rate=50.0, peak_valley_ratio=35.0, period_s=100.0)
    assert profile.peak_rate / profile.valley_rate == pytest.approx(35.0)
    assert profile.rate(0.0) == pytest.approx(profile.valley_rate)
    assert profile.rate(50.0) == pytest.approx(profile.peak_rate)
    times = arr.diurnal_arrivals(profile, random.Random(2), duration_s=2000.0)
    assert len(times) / 2000.0 == pytest.approx(50.0, rel=0.03)
    half = 2.5   # windows of +-2.5 s around each valley (t = 0 mod 100) and peak (t = 50 mod 100)
    phase = [t % 100.0 for t in times]
    valley = sum(1 for p in phase if p < half or p > 100.0 - half)
    peak = sum(1 for p in phase if abs(p - 50.0) < half)
    expected = _window_mean(profile, 50.0, half) / _window_mean(profile, 0.0, half)
    assert valley > 200
    assert peak / valley == pytest.approx(expected, rel=0.15)
    assert expected > 30


def _window_mean(profile: arr.DiurnalProfile, centre: float, half: float, steps: int = 1000) -> float:
    return statistics.fmean(profile.rate(centre - half + 2 * half * (i + 0.5) / steps) for i in range(steps))


def test_trace_files(tmp_path):
    csv_path = tmp_path / "azure.csv"
    csv_path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:47.5000000,10\n"
                        "2023-11-16 18:15:46.0000000,20\n2023-11-16 18:15:50.0000000,30\n")
    assert arr.trace_arrivals(csv_path) == pytest.approx([0.0, 1.5, 4.0])
    assert arr.trace_arrivals(csv_path, speedup=2.0) == pytest.approx([0.0, 0.75, 2.0])
    jsonl = tmp_path / "trace.jsonl"
    jsonl.write_text("\n".join(json.dumps({"arrival_time": t}) for t in (100.0, 100.5, 103.0, 109.0)))
    assert arr.trace_arrivals(jsonl, n=2) == [0.0, 0.5]
    assert arr.trace_arrivals(jsonl, duration_s=5.0) == [0.0, 0.5, 3.0]
    assert arr.make_arrivals(str(jsonl), 1.0, random.Random(0), n=10) == [0.0, 0.5, 3.0, 9.0]
    with pytest.raises(ValueError, match="timestamp column"):
        (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
        arr.trace_arrivals(tmp_path / "bad.csv")


# ---- augmented traces -------------------------------------------------------------------------

def test_augmented_traces_respect_profiles():
    profiles = aug.load_profiles()
    assert set(profiles.types) == {"math", "qa", "ve", "chatbot", "image", "tts"}
    for name, p in profiles.types.items():
        for req in aug.sample_augmented(200, random.Random(3), name, profiles):
            assert req.type == name
            assert p.calls[0] <= req.num_calls <= p.calls[1] and len(req.segments) == req.num_calls + 1
            assert profiles.prompt_tokens[0] <= req.prompt_tokens <= profiles.prompt_tokens[1]
            assert all(p.gen_tokens[0] <= s.completion_tokens <= p.gen_tokens[1] for s in req.segments)
            assert all(p.return_tokens[0] <= s.return_tokens <= p.return_tokens[1] for s in req.segments[:-1])
            assert req.segments[-1].api_time_s == 0 and req.segments[-1].return_tokens == 0
    times = [s.api_time_s for r in aug.sample_augmented(2000, random.Random(4), "qa", profiles)
             for s in r.segments[:-1]]
    assert statistics.median(times) == pytest.approx(0.6, rel=0.1)


def test_augmented_mixture_and_determinism():
    a = aug.sample_augmented(3000, random.Random(5))
    assert a == aug.sample_augmented(3000, random.Random(5))
    counts = {t: sum(1 for r in a if r.type == t) / len(a) for t in aug.load_profiles().types}
    assert all(abs(share - 1 / 6) < 0.03 for share in counts.values()), counts
    with pytest.raises(ValueError):
        aug.sample_augmented(1, random.Random(0), "nope")


def test_segment_schema_round_trip(tmp_path):
    reqs = aug.sample_augmented(20, random.Random(6))
    segs = aug.to_infercept(reqs[0])
    assert set(segs[0]) == {"prompt_tokens", "completion_tokens", "api_time", "api_token_length"}
    assert segs[0]["prompt_tokens"] == reqs[0].prompt_tokens
    for prev, cur in zip(segs, segs[1:]):   # context grows by the completion and the tool return
        grown = prev["prompt_tokens"] + prev["completion_tokens"] + prev["api_token_length"]
        assert cur["prompt_tokens"] == grown
    path = tmp_path / "trace.json"
    aug.save_trace(path, reqs, "bundled")
    assert aug.load_trace(path) == reqs
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps([aug.to_infercept(r) for r in reqs]))
    assert [r.segments for r in aug.load_trace(bare)] == [r.segments for r in reqs]
    items = load_dataset(str(path), n=5, seed=0)
    assert len(items) == 5 and all(it.augmented in reqs for it in items)


# ---- datasets ---------------------------------------------------------------------------------

def words(k: int) -> str:
    return " ".join(f"w{i}" for i in range(k))


def sharegpt_text(pairs: list[tuple[str, str]]) -> str:
    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": r}]}
               for i, (p, r) in enumerate(pairs)]
    records.insert(1, {"id": "no-reply", "conversations": [{"from": "human", "value": words(10)}]})
    return json.dumps(records, indent=2, ensure_ascii=False)


def truncated(text: str) -> bytes:
    """Cut the text inside its last record, in the middle of a multi-byte character."""
    data = text.encode()
    cut = data.rindex("é".encode()) + 1
    return data[:cut]


SHAREGPT_PAIRS = [(words(10), words(20)), (words(3), words(20)), (words(1100), words(10)),
                  (words(1000), words(1100)), (words(30), words(2)), (words(50), words(60)),
                  (words(8), words(9) + " caf\u00e9")]


def test_sharegpt_parsing_of_a_truncated_file(tmp_path):
    path = tmp_path / "share.json"
    path.write_bytes(truncated(sharegpt_text(SHAREGPT_PAIRS)))
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(errors="replace"))
    count = lambda s: len(s.split())  # noqa: E731
    items = load_dataset(str(path), count_tokens=count)
    # kept: (10, 20) and (50, 60); dropped: prompt < 4, prompt > 1024, total > 2048, reply < 4,
    # a conversation without a reply, and the cut-short last record
    assert [(it.prompt_tokens, it.max_tokens) for it in items] == [(10, 20), (50, 60)]
    assert items[0].messages == [{"role": "user", "content": words(10)}] and items[0].kind == "sharegpt"
    sampled = load_dataset(str(path), n=5, seed=1, count_tokens=count)
    assert len(sampled) == 5 and sampled == load_dataset(str(path), n=5, seed=1, count_tokens=count)


def test_iter_json_array_stops_at_truncation():
    assert list(iter_json_array('[ {"a": 1}, {"b": [2, 3]} , {"c": ')) == [{"a": 1}, {"b": [2, 3]}]
    assert list(iter_json_array("[]")) == []


def test_named_datasets_read_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "datasets"
    cache.mkdir()
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x.\"\"\"\n",
                 "entry_point": f"f{i}", "canonical_solution": "    return x\n", "test": ""}
                for i in range(3)]
    with gzip.open(cache / "HumanEval.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(p) for p in problems) + "\n")
    sharegpt = truncated(sharegpt_text(SHAREGPT_PAIRS))
    (cache / "ShareGPT_V3_unfiltered_cleaned_split.json").write_bytes(sharegpt)
    he = load_dataset("humaneval")
    assert [it.prompt for it in he] == [p["prompt"] for p in problems]
    assert "def f0(x)" in he[0].messages[0]["content"] and he[0].kind == "humaneval"
    assert len(load_dataset("sharegpt", count_tokens=lambda s: len(s.split()))) == 2
    # The function whole (its solution included) in the ask; the output may run 1.5x its tokens + 32.
    edit = load_dataset("humaneval-edit", count_tokens=lambda s: len(s.split()))
    code = problems[0]["prompt"] + problems[0]["canonical_solution"]
    assert edit[0].kind == "humaneval-edit" and f"```python\n{code}```" in edit[0].messages[0]["content"]
    assert edit[0].max_tokens == len(code.split()) * 3 // 2 + 32
    # An agent transcript: earlier JSON tool calls on the problem's own function, then a user turn.
    tools = load_dataset("humaneval-tools")
    assert [it.kind for it in tools] == ["humaneval-tools"] * 3
    for i, it in enumerate(tools):
        calls = [json.loads(m["content"]) for m in it.messages if m["role"] == "assistant"]
        assert 2 <= len(calls) <= 5 and it.messages[-1]["role"] == "user"
        assert calls[0] == {"name": "read_file", "arguments": {"path": f"src/problem_{i}.py"}}
        assert calls[1]["arguments"]["test"] == f"tests/test_problem_{i}.py::test_f{i}"
    assert [m["content"] for m in load_dataset("humaneval-tools")[2].messages] == \
        [m["content"] for m in tools[2].messages]                 # the same transcript every time


def test_prompt_set_and_user_jsonl(tmp_path):
    prompts = load_dataset("prompts")
    assert len(prompts) == 36 and prompts[0].source == "prompts"
    cycled = load_dataset("prompts", n=50, seed=3)
    assert len(cycled) == 50 and {it.prompt for it in cycled} == {it.prompt for it in prompts}
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "kind": "greet"},
        {"prompt": "Once upon a time", "output_len": 11}, {"task_id": "X/1", "prompt": "def g():\n"}]) + "\n")
    items = load_dataset(str(path))
    assert [(it.kind, it.max_tokens) for it in items] == [("greet", 7), ("text", 11), ("humaneval", 256)]
    assert items[1].messages == [{"role": "user", "content": "Once upon a time"}]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_dataset(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("no-such-dataset")


def test_augmented_dataset_items():
    items = load_dataset("augmented:math", n=10, seed=2)
    assert items == load_dataset("augmented:math", n=10, seed=2)
    for it in items:
        assert it.kind == "math" and it.augmented is not None
        assert estimate_tokens(it.prompt) == it.prompt_tokens == it.augmented.prompt_tokens
        assert it.max_tokens == it.augmented.output_tokens


# ---- the seam: no torch, no clock -------------------------------------------------------------

NO_TORCH_SCRIPT = """
    import random
    from tandem.workload import arrivals, augmented, datasets, fetch, prompts  # noqa: F401
    rng = random.Random(0)
    n = len(arrivals.diurnal_arrivals(arrivals.DiurnalProfile(5.0, 35.0, 10.0), rng, n=50))
    items = datasets.load_dataset("augmented", n=3, seed=0) + datasets.load_dataset("prompts", n=2)
    assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")]
    print("ok", n, len(items))
"""


def test_workload_imports_and_runs_without_torch():
    proc = run_without_torch(NO_TORCH_SCRIPT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "50", "5"]


def test_workload_reads_no_clock_and_imports_no_torch():
    forbidden = re.compile(r"^\s*(?:import\s+(?:torch|time)\b|from\s+(?:torch|time)\b)"
                           r"|\btime\.(?:time|monotonic|perf_counter)\(|datetime\.now\(", re.MULTILINE)
    offenders = [p.name for p in WORKLOAD.rglob("*.py") if forbidden.search(p.read_text())]
    assert not offenders


def test_estimate_tokens_is_cheap_and_sane():
    assert estimate_tokens("Hello, world!") == 4
    assert math.isclose(estimate_tokens(words(100)), 100)


def test_script_cursor_ends_segments_at_their_lengths_counting_whole_steps():
    """The one scripted-tool rule (engine ToolRuntime and simulator): segment i ends at the step
    that reaches its length; the last segment never ends (it ends with the request)."""
    from tandem.workload.augmented import ScriptCursor

    c = ScriptCursor([3, 2, 5])
    assert [c.on_tokens(1), c.on_tokens(1), c.on_tokens(1)] == [None, None, 0]
    assert c.on_tokens(4) == 1                  # a verification step of 4 tokens crosses the mark
    assert [c.on_tokens(100), c.segment] == [None, 2]
