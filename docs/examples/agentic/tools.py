"""An example tool executor for ``tool_results: executor``: a calculator and a lookup over a local JSON file.

Use it with ``producer submit … --turns all --tool-results executor --tool-executor
docs/examples/agentic/tools.py:execute`` and workers started with
``worker --tool-executors docs/examples/agentic/tools.py:execute`` (or ``THINKFLEET_TOOL_EXECUTORS``: a worker runs
only executors it lists). ``bash scripts/demo.sh --agentic`` runs it on the simulator, end to end.
The simulator's tool catalogue (``sglang_sim.tools.DEFAULT_TOOLS``) calls exactly these two tools.

The request (workers/tool_exec.py): ``{"job", "conversation", "turn", "step", "calls": [{"id", "name",
"arguments"}]}``; the answer: one result per call, in order. ``id`` is stable across retries of a step that make
the same calls (other calls of a regenerated step get other ids), so an executor with side effects can deduplicate
on it.
"""

from __future__ import annotations

import ast
import json
import operator
from pathlib import Path
from typing import Any

#: The lookup's table (``{"key": "value"}``).
FACTS = Path(__file__).with_name("facts.json")

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def _eval(node: ast.AST) -> float:
    """Arithmetic only: numbers and + - * / ** (never Python's eval)."""
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * / ** are allowed")


def calculator(expression: str) -> str:
    value = _eval(ast.parse(expression, mode="eval"))
    return str(int(value) if float(value).is_integer() else value)


def lookup(key: str) -> str:
    facts = json.loads(FACTS.read_text())
    return str(facts.get(key, f"no entry for {key!r}"))


def execute(request: dict[str, Any]) -> list[str]:
    """One result per call; a call the tools cannot answer gets an error text (the model sees it, as from a real
    tool), not an exception (which the worker would retry and then end the chain with)."""
    out = []
    for call in request["calls"]:
        try:
            args = json.loads(call["arguments"]) if isinstance(call["arguments"], str) else call["arguments"]
            if call["name"] == "calculator":
                out.append(calculator(str(args["expression"])))
            elif call["name"] == "lookup":
                out.append(lookup(str(args["key"])))
            else:
                out.append(f"error: no tool named {call['name']!r}")
        except (ValueError, KeyError, TypeError, ZeroDivisionError, SyntaxError) as exc:
            out.append(f"error: {type(exc).__name__}: {exc}")
    return out
