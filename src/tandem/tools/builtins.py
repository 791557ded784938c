"""Built-in tools: a safe calculator (an arithmetic parser over Python's AST, never eval) and BM25
retrieval over a folder of text documents (the rank-bm25 library)."""

from __future__ import annotations

import ast
import math
import operator
import re
from pathlib import Path

CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression, e.g. '(3 + 4) * sqrt(2)'.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
RETRIEVE_SCHEMA = {"type": "function", "function": {
    "name": "retrieve", "description": "Search the document collection; returns the best matching passages.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                   "required": ["query"]}}}

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "sin": math.sin, "cos": math.cos, "tan": math.tan, "log": math.log,
          "log10": math.log10, "exp": math.exp, "abs": abs, "round": round, "min": min, "max": max,
          "floor": math.floor, "ceil": math.ceil}
_CONSTS = {"pi": math.pi, "e": math.e}
_MAX_EXPONENT = 1000
_MAX_CHARS = 500


class CalculatorError(ValueError):
    pass


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses, math functions)."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("expression must be a non-empty string")
    if len(expression) > _MAX_CHARS:
        raise CalculatorError(f"expression longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise CalculatorError(f"exponent larger than {_MAX_EXPONENT}")
        try:
            return _BINOPS[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as e:
            raise CalculatorError(str(e)) from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        try:
            return _FUNCS[node.func.id](*[_eval(a) for a in node.args])
        except (ValueError, TypeError, OverflowError) as e:
            raise CalculatorError(f"{node.func.id}: {e}") from None
    raise CalculatorError(f"unsupported syntax: {ast.dump(node)[:60]}")


_TOKEN = re.compile(r"\w+")


class Retriever:
    """BM25 over the paragraphs of the .txt/.md files in a folder (the bundled notes by default)."""

    def __init__(self, docs_dir: str | Path | None = None) -> None:
        from importlib import resources

        from rank_bm25 import BM25Okapi

        root = Path(docs_dir) if docs_dir else Path(str(resources.files("tandem.tools").joinpath("docs")))
        self.passages: list[tuple[str, str]] = []
        for f in sorted(root.glob("**/*")):
            if f.suffix in (".txt", ".md") and f.is_file():
                for para in re.split(r"\n\s*\n", f.read_text(encoding="utf-8", errors="replace")):
                    if para.strip():
                        self.passages.append((f.name, para.strip()))
        corpus = [self._tokens(p) for _, p in self.passages] or [[""]]
        self.bm25 = BM25Okapi(corpus)

    @staticmethod
    def _tokens(text: str) -> list[str]:
        return [t.lower() for t in _TOKEN.findall(text)]

    def search(self, query: str, k: int = 3) -> str:
        """The k passages that best match `query`, with their source file."""
        if not self.passages:
            return "no documents"
        scores = self.bm25.get_scores(self._tokens(str(query)))
        k = max(1, min(int(k), 10))
        best = sorted(range(len(scores)), key=lambda i: -scores[i])[:k]
        return "\n\n".join(f"[{self.passages[i][0]}] {self.passages[i][1]}" for i in best)
