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
_MAX_DIGITS = 4000                  # the largest integer result (and operand) in decimal digits
_MAX_ROUND_DIGITS = 1000            # |ndigits| of round(): round(x, -n) computes 10**n
_LOG10_2 = math.log10(2)


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
        value = _eval(tree.body)
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("expression nested too deeply") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def _digits(x: float) -> float:
    """About how many decimal digits the integer x has (floats are bounded by their type: 0)."""
    return x.bit_length() * _LOG10_2 if isinstance(x, int) else 0.0


def _check_size(op: ast.operator, left: float, right: float) -> None:
    """Refuse, before computing, an integer power or product with more than _MAX_DIGITS digits:
    Python computes those exactly, however long it takes (holding the GIL all the while). Both
    operands are results already bounded the same way, so nesting cannot build a bigger one."""
    if isinstance(op, ast.Pow):
        if abs(right) > _MAX_EXPONENT:
            raise CalculatorError(f"exponent larger than {_MAX_EXPONENT}")
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            estimate = math.log10(abs(left)) * right
            if estimate > _MAX_DIGITS:
                raise CalculatorError(f"result too large: about {estimate:.0f} digits, the limit is {_MAX_DIGITS}")
    elif isinstance(op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
        estimate = _digits(left) + _digits(right)
        if estimate > _MAX_DIGITS + 1:
            raise CalculatorError(f"result too large: about {estimate:.0f} digits, the limit is {_MAX_DIGITS}")


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        if isinstance(node.value, int) and _digits(node.value) > _MAX_DIGITS + 1:
            raise CalculatorError(f"number too large: the limit is {_MAX_DIGITS} digits")
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        _check_size(node.op, left, right)
        try:
            return _BINOPS[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as e:
            raise CalculatorError(str(e)) from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        args = [_eval(a) for a in node.args]
        if node.func.id == "round" and len(args) > 1 and isinstance(args[1], int) and abs(args[1]) > _MAX_ROUND_DIGITS:
            raise CalculatorError(f"round: ndigits too large: the limit is {_MAX_ROUND_DIGITS}")
        try:
            return _FUNCS[node.func.id](*args)
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
