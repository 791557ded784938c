"""Architecture seams: the scheduler and the KV bookkeeping are plain Python (the simulator's path).

They must import and run with torch unavailable, and must not read a clock (time is passed in as `now`).
Tandem's packages (and top-level modules) import each other without cycles: every import counts,
lazy ones inside functions too.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import tandem
from tests.doubles import run_without_torch

SRC = Path(tandem.__file__).resolve().parent
POLICY_DIRS = ("sched", "kv", "router")
FORBIDDEN = re.compile(
    r"^\s*(?:import\s+torch\b|from\s+torch\b|import\s+time\b|from\s+time\s+import\b)"
    r"|\btime\.(?:time|monotonic|perf_counter)\(",
    re.MULTILINE,
)

NO_TORCH_SCRIPT = """

    import tandem.kv
    import tandem.sched
    import tandem.sched.scheduler
    from tandem.config import SchedulerConfig
    from tandem.sampling_params import SamplingParams
    from tandem.types import Request, StepResult

    kv = tandem.kv.KVCacheManager(num_blocks=8, block_size=4)
    sched = tandem.sched.Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=32), kv)
    sched.add_request(Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True)))
    now = 0.0
    while sched.has_unfinished():
        plan = sched.schedule(now)
        result = StepResult({s.request_id: [7] for s in plan.seqs if s.sample})
        sched.update(plan, result, now)
        now += 1.0
    assert kv.num_free_blocks == kv.num_blocks
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers") and sys.modules[m] is not None)
    assert not heavy, heavy
    print("ok", sched.num_steps)
"""


def policy_files() -> list[Path]:
    return sorted(p for d in POLICY_DIRS for p in (SRC / d).rglob("*.py"))


def test_sched_and_kv_import_and_run_without_torch():
    """tandem.sched / tandem.kv import and a schedule/update loop runs when torch cannot be imported."""
    proc = run_without_torch(NO_TORCH_SCRIPT, timeout=60, cwd=SRC.parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "3"]      # one prefill step, then two decode steps


def test_forbidden_pattern_detects_violations():
    """The static check's regex is not vacuous: it catches every form it is meant to."""
    bad = ["import torch", "from torch import nn", "import time", "from time import monotonic",
           "    import torch.nn as nn", "t = time.time()", "t = time.monotonic()", "t = time.perf_counter()"]
    for line in bad:
        assert FORBIDDEN.search(line), line
    ok = ["import timeit", "from tandem.types import RequestTimes", "now: float  # time is passed in",
          "request.times.first_token = now", "import torchvision"]
    for line in ok:
        assert not FORBIDDEN.search(line), line


def test_policy_package_files_exist():
    names = {p.relative_to(SRC).as_posix() for p in policy_files()}
    assert {"sched/scheduler.py", "kv/manager.py", "kv/block_pool.py"} <= names


@pytest.mark.parametrize("path", policy_files(), ids=lambda p: p.relative_to(SRC).as_posix())
def test_policy_code_uses_no_torch_and_no_clock(path):
    """No file under tandem/sched or tandem/kv imports torch or reads the wall clock."""
    hits = [m.group(0).strip() for m in FORBIDDEN.finditer(path.read_text())]
    assert not hits, f"{path.name}: {hits}"


NO_RAY = re.compile(r"^\s*(?:import\s+ray\b|from\s+ray\b)", re.MULTILINE)


@pytest.mark.parametrize("path", sorted((SRC / "router").rglob("*.py")), ids=lambda p: p.relative_to(SRC).as_posix())
def test_router_is_pure(path):
    """The routing policy (shared by the simulator and the Ray Serve router) imports neither ray nor torch."""
    assert not NO_RAY.findall(path.read_text()), path.name
    assert "tandem.sim" not in path.read_text() and "tandem.cluster" not in path.read_text(), path.name


# --- No import cycles between tandem's packages -------------------------------------------------
# A unit is a subpackage (tandem.sched, tandem.bench, ...) or a top-level module (tandem.config,
# tandem.cli, ...); "tandem" is the root package's __init__. Every `import` / `from ... import` of a
# tandem module counts wherever it sits (module level, inside a function, under a condition): a
# lazy import is still a dependency, and hiding one inside a function is how cycles crept in.


def _module_name(path: Path, src: Path) -> str:
    parts = ("tandem", *path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """The unit a dotted tandem module belongs to: tandem.sched.policies -> sched; tandem -> tandem."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tandem"


def tandem_imports(source: str, module: str, is_package: bool, src: Path) -> Iterator[tuple[str, int]]:
    """(imported tandem module, line) for every import in `source`, the text of `module`."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                  # relative: from . / from ..x import y
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            names = [base]
            if base == "tandem":                            # from tandem import sched, __version__
                names = [f"tandem.{a.name}" if ((src / a.name).is_dir() or (src / f"{a.name}.py").is_file())
                         else "tandem" for a in node.names]
        else:
            continue
        for name in names:
            if name == "tandem" or name.startswith("tandem."):
                yield name, node.lineno


def import_graph(src: Path = SRC) -> dict[str, dict[str, list[str]]]:
    """{importer unit: {imported unit: ["file:line (module)", ...]}}, imports within a unit left out."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(src.rglob("*.py")):
        module = _module_name(path, src)
        here = _unit(module)
        for name, line in tandem_imports(path.read_text(), module, path.name == "__init__.py", src):
            there = _unit(name)
            if there != here:
                graph.setdefault(here, {}).setdefault(there, []).append(
                    f"{path.relative_to(src).as_posix()}:{line} ({name})")
    return graph


def find_cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Every elementary cycle, each as its units in order starting from its smallest name."""
    cycles: list[list[str]] = []

    def walk(start: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], {})):
            if nxt == start:
                cycles.append(list(path))
            elif nxt > start and nxt not in path:
                walk(start, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return cycles


def describe_cycles(graph: dict[str, dict[str, list[str]]], cycles: list[list[str]]) -> str:
    lines = [f"{len(cycles)} import cycle(s) between tandem's packages (lazy imports count):"]
    for cycle in cycles:
        lines.append("  " + " -> ".join(cycle + cycle[:1]))
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            sites = graph[a][b]
            more = f", ... ({len(sites)} in all)" if len(sites) > 3 else ""
            lines.append(f"      {a} -> {b}: " + ", ".join(sites[:3]) + more)
    return "\n".join(lines)


def test_import_graph_sees_every_form_of_import(tmp_path):
    """The graph is not vacuous: module-level, lazy, `from tandem import X`, aliased and relative
    imports all make edges; imports inside one package and of other projects do not."""
    pkg = tmp_path / "tandem"
    for d in ("a", "b", "c", "d", "e"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("")
    (pkg / "a" / "x.py").write_text("import tandem.b.y\nfrom tandem.a import z\nimport torch\n")
    (pkg / "b" / "y.py").write_text("def f():\n    if True:\n        from tandem.c.w import g\n")
    (pkg / "c" / "w.py").write_text("from tandem import a, top, __version__\nfrom .. import d\n")
    (pkg / "d" / "__init__.py").write_text("from ..e import thing\nimport tandem.top as t\n")
    (pkg / "e" / "__init__.py").write_text("from . import inner\n")
    graph = import_graph(pkg)
    assert {u: sorted(v) for u, v in graph.items()} == {
        "a": ["b"], "b": ["c"], "c": ["a", "d", "tandem", "top"], "d": ["e", "top"]}
    assert graph["b"]["c"] == ["b/y.py:3 (tandem.c.w)"]
    assert find_cycles(graph) == [["a", "b", "c"]]
    text = describe_cycles(graph, find_cycles(graph))
    assert "a -> b -> c -> a" in text and "c -> a: c/w.py:1 (tandem.a)" in text


def test_find_cycles_names_each_cycle_once():
    graph = {"a": {"b": ["1"]}, "b": {"a": ["2"], "c": ["3"]}, "c": {"a": ["4"]}, "d": {"a": ["5"]}}
    assert find_cycles(graph) == [["a", "b"], ["a", "b", "c"]]
    assert find_cycles({"a": {"b": ["1"]}, "b": {"c": ["2"]}}) == []


def test_no_import_cycles_between_packages():
    """tandem's packages form a DAG: each cycle is named with the import lines that close it."""
    graph = import_graph()
    assert {"sched", "kv", "runner", "models", "speculative", "sim", "bench", "config"} <= set(graph)
    cycles = find_cycles(graph)
    assert not cycles, describe_cycles(graph, cycles)


def _is_module(name: str, src: Path) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    return name == "tandem" or (src / rel).with_suffix(".py").is_file() or (src / rel / "__init__.py").is_file()


def module_graph(src: Path = SRC) -> dict[str, set[str]]:
    """{module: tandem modules it imports}, each module its own node (a package is its __init__):
    `from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg` (whose
    __init__ defines the name). Lazy imports count, as in import_graph."""
    graph: dict[str, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        module = _module_name(path, src)
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.split(".")[0] == "tandem")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                if base.split(".")[0] != "tandem":
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    edges.add(sub if _is_module(sub, src) else base)
        edges.discard(module)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_strongly_connected_finds_module_circles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert strongly_connected(g) == [["a", "b", "c"]]


def test_no_import_circles_between_modules():
    """Inside a package too: no module imports (directly or through others) one that imports it
    back, lazy imports included."""
    circles = strongly_connected(module_graph())
    assert not circles, "module import circles:\n" + "\n".join("  " + " <-> ".join(c) for c in circles)


def test_module_graph_tells_a_submodule_from_a_name_its_package_defines(tmp_path):
    pkg = tmp_path / "tandem"
    (pkg / "p").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "p" / "__init__.py").write_text("from tandem.p.m import f\nX = 1\n")
    (pkg / "p" / "m.py").write_text("def f():\n    from tandem.p import X\n")
    (pkg / "p" / "n.py").write_text("from . import m\nfrom tandem.p import m as mm\n")
    graph = module_graph(pkg)
    assert graph["tandem.p"] == {"tandem.p.m"} and graph["tandem.p.m"] == {"tandem.p"}
    assert graph["tandem.p.n"] == {"tandem.p.m"}
    assert strongly_connected(graph) == [["tandem.p", "tandem.p.m"]]
