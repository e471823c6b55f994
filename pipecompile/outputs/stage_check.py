"""A saved stage file read as a graph: only the statement forms torch.fx writes, nothing else.

`pipecompile.load` rebuilds each stage by executing its Python source and tracing it
(`graph_code.build_module`). Executed as it stands, a line appended to the file would run on
load. `check_stage_source` reads the file with `ast` first and refuses, with a
`StageCodeError` naming the file and line, anything that is not what fx's code generation
writes for a saved stage (`graph_code.module_source`):

    module       a docstring; the imports fx's generated code binds (`import torch`,
                 `from math import inf`, `from torch import device`, the pytree modules, ...);
                 `NoneType = type(None)`; `from pipecompile.ir.rng import seeded_call as ...`;
                 `SUBMODULES = {'path': 'Class'}`; classes `Name(torch.nn.Module)`
    class        one `def forward(self, a, b, ...)`: plain arguments, no defaults beyond
                 constants, no annotations beyond names
    forward      `name = <expression>`, `a = b = None` (fx freeing values), `return <expression>`
    expression   constants, tuples, lists, dicts and slices of them; names bound earlier;
                 `self.a.b` and `getattr(self.a, "0")` (the module's parameters, buffers and
                 inner graphs); `torch.<dtype/layout/memory format>`; calls of
                 `torch.ops.<namespace>.<op>[.<overload>]` that resolve to operators, of
                 `device(...)`, of `getattr(value, "attribute")` and of the seeded random op
                 wrapper; operators (`a + b`, `-a`, `a[0]`, `a < b`) on names and constants

Any name beginning with a double underscore is refused, and so is every other call, a lambda,
a comprehension, an import of anything else. What passes defines classes and, traced, records
operator calls into a graph: executing it runs nothing but torch's own operators.
`pipecompile.load(..., trust_code=True)` skips the check.
"""

from __future__ import annotations

import ast
from typing import Any

import torch

from ..errors import PipecompileError

__all__ = ["StageCodeError", "check_stage_source"]


class StageCodeError(PipecompileError, ValueError):
    """A saved stage file holds something torch.fx does not write (`check_stage_source`)."""


#: The import lines fx's generated code needs (torch.fx.graph's custom builtins).
_IMPORTS = {
    ("math", "inf", "inf"), ("math", "nan", "nan"), ("torch", "device", "device"),
    ("pipecompile.ir.rng", "seeded_call", None),
}
_MODULE_IMPORTS = {("torch", None), ("torch.fx._pytree", "fx_pytree"),
                   ("torch.utils._pytree", "pytree"), ("operator", None), ("math", None)}
_GLOBALS = {"inf", "nan", "device", "torch", "NoneType", "fx_pytree", "pytree", "operator",
            "math", "self"}
_TENSOR_KINDS = (torch.dtype, torch.layout, torch.memory_format)


def check_stage_source(source: str, filename: str) -> None:
    """Raise `StageCodeError` at the first statement of `source` (the file `filename`) that
    fx's code generation does not write."""
    _Checker(filename).module(ast.parse(source, filename))


class _Checker:
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.globals = set(_GLOBALS)
        self.callables: set[str] = set()  # imported functions a forward may call

    def refuse(self, node: ast.AST, what: str) -> None:
        line = getattr(node, "lineno", 0)
        raise StageCodeError(
            f"{self.filename}:{line}: {what} is not what torch.fx writes for a saved stage, so "
            f"the directory will not be loaded (it may have been edited to run code); load "
            f"only directories you trust, with pipecompile.load(..., trust_code=True) to run "
            f"this file as Python")

    # -- module level ---------------------------------------------------------------------

    def module(self, tree: ast.Module) -> None:
        for i, statement in enumerate(tree.body):
            if (i == 0 and isinstance(statement, ast.Expr)
                    and isinstance(statement.value, ast.Constant)
                    and isinstance(statement.value.value, str)):
                continue  # the docstring
            if isinstance(statement, ast.Import):
                self.import_(statement)
            elif isinstance(statement, ast.ImportFrom):
                self.import_from(statement)
            elif isinstance(statement, ast.Assign):
                self.module_assign(statement)
            elif isinstance(statement, ast.ClassDef):
                self.class_(statement)
            else:
                self.refuse(statement, f"a module-level {type(statement).__name__}")

    def import_(self, statement: ast.Import) -> None:
        for alias in statement.names:
            if (alias.name, alias.asname) not in _MODULE_IMPORTS:
                self.refuse(statement, f"'import {alias.name}'")

    def import_from(self, statement: ast.ImportFrom) -> None:
        for alias in statement.names:
            allowed = any(m == statement.module and n == alias.name
                          and (a is None or a == (alias.asname or alias.name))
                          for m, n, a in _IMPORTS)
            if statement.level != 0 or not allowed:
                self.refuse(statement, f"'from {statement.module} import {alias.name}'")
            bound = alias.asname or alias.name
            if alias.name == "seeded_call":
                if bound in self.globals or bound.startswith("__"):
                    self.refuse(statement, f"seeded_call imported as {bound!r}")
                self.callables.add(bound)
            self.globals.add(bound)

    def module_assign(self, statement: ast.Assign) -> None:
        target = statement.targets[0] if len(statement.targets) == 1 else None
        name = target.id if isinstance(target, ast.Name) else None
        value = statement.value
        if name == "NoneType" and ast.dump(value) == ast.dump(
                ast.parse("type(None)", mode="eval").body):
            return
        if name == "SUBMODULES" and isinstance(value, ast.Dict) and all(
                isinstance(x, ast.Constant) and isinstance(x.value, str)
                for x in [*value.keys, *value.values]):
            return
        self.refuse(statement, "a module-level assignment")

    def class_(self, statement: ast.ClassDef) -> None:
        base = statement.bases[0] if len(statement.bases) == 1 else None
        if (statement.decorator_list or statement.keywords or base is None
                or _dotted(base) != "torch.nn.Module"):
            self.refuse(statement, f"class {statement.name} (not a plain torch.nn.Module)")
        body = statement.body
        if len(body) != 1 or not isinstance(body[0], ast.FunctionDef) or (
                body[0].name != "forward"):
            self.refuse(body[0] if body else statement,
                        f"a class body other than one forward method in {statement.name}")
        self.forward(body[0])  # type: ignore[arg-type]

    # -- forward ----------------------------------------------------------------------------

    def forward(self, fn: ast.FunctionDef) -> None:
        args = fn.args
        if (fn.decorator_list or fn.returns is not None or args.vararg or args.kwarg
                or args.posonlyargs or args.kwonlyargs or not args.args
                or args.args[0].arg != "self"):
            self.refuse(fn, "a forward other than 'def forward(self, inputs...)'")
        for default in args.defaults:
            if not _constant(default):
                self.refuse(default, "a default argument that is not a constant")
        for arg in args.args:
            if arg.annotation is not None and not (_constant(arg.annotation)
                                                   or _dotted(arg.annotation)):
                self.refuse(arg, f"the annotation of argument {arg.arg!r}")
            self.dunder(arg, arg.arg)
        local = {a.arg for a in args.args} - {"self"}
        for statement in fn.body:
            if isinstance(statement, ast.Assign):
                if all(isinstance(t, ast.Name) for t in statement.targets) and (
                        len(statement.targets) > 1 or isinstance(statement.value, ast.Constant)):
                    if not (isinstance(statement.value, ast.Constant)
                            and statement.value.value is None):
                        self.refuse(statement, "a chained assignment other than 'a = b = None'")
                    continue  # fx freeing values it no longer needs
                target = statement.targets[0] if len(statement.targets) == 1 else None
                if not isinstance(target, ast.Name):
                    self.refuse(statement, "an assignment to something other than a name")
                self.dunder(statement, target.id)  # type: ignore[union-attr]
                self.expression(statement.value, local)
                local.add(target.id)  # type: ignore[union-attr]
            elif isinstance(statement, ast.Return) and statement.value is not None:
                self.expression(statement.value, local)
            elif isinstance(statement, ast.Pass):
                continue
            else:
                self.refuse(statement, f"a {type(statement).__name__} statement in forward")

    def expression(self, node: ast.expr, local: set[str]) -> None:
        if _constant(node):
            return
        if isinstance(node, ast.Name):
            if node.id not in local and node.id not in self.globals:
                self.refuse(node, f"the name {node.id!r} (neither a value nor an fx global)")
            return
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for item in node.elts:
                self.expression(item, local)
            return
        if isinstance(node, ast.Dict):
            for entry in [*node.keys, *node.values]:
                if entry is None:
                    self.refuse(node, "a '**' in a dict")
                else:
                    self.expression(entry, local)
            return
        if isinstance(node, ast.Slice):
            for part in (node.lower, node.upper, node.step):
                if part is not None:
                    self.expression(part, local)
            return
        if isinstance(node, ast.Attribute):
            self.attribute(node)
            return
        if isinstance(node, ast.Call):
            self.call(node, local)
            return
        if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Compare, ast.Subscript)):
            operands = {ast.BinOp: lambda n: [n.left, n.right],
                        ast.UnaryOp: lambda n: [n.operand],
                        ast.Compare: lambda n: [n.left, *n.comparators],
                        ast.Subscript: lambda n: [n.value, n.slice]}[type(node)](node)
            for operand in operands:
                if isinstance(operand, ast.Name) and operand.id not in local | {"inf", "nan"}:
                    self.refuse(node, f"an operator on {operand.id!r}, which is not a value")
                self.expression(operand, local)
            return
        self.refuse(node, f"a {type(node).__name__} expression")

    def attribute(self, node: ast.Attribute) -> None:
        """`self.a.b` (or through `getattr(self.a, "0")`), or `torch.<dtype>`."""
        self.dunder(node, node.attr)
        if _dotted(node.value) == "torch":
            if isinstance(getattr(torch, node.attr, None), _TENSOR_KINDS):
                return
            self.refuse(node, f"torch.{node.attr}")
        if not self.self_chain(node):
            self.refuse(node, f"the attribute .{node.attr} of something other than the module")

    def self_chain(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id == "self"
        if isinstance(node, ast.Attribute):
            self.dunder(node, node.attr)
            return self.self_chain(node.value)
        if _is_getattr(node):
            self.dunder(node, node.args[1].value)  # type: ignore[attr-defined]
            return self.self_chain(node.args[0])  # type: ignore[attr-defined]
        return False

    def call(self, node: ast.Call, local: set[str]) -> None:
        for keyword in node.keywords:
            if keyword.arg is None:
                self.refuse(node, "a '**' argument")
            self.expression(keyword.value, local)
        for argument in node.args:
            if isinstance(argument, ast.Starred):
                self.refuse(node, "a '*' argument")
        func = node.func
        if _is_getattr(node):
            target = node.args[0]
            if self.self_chain(node) or (isinstance(target, ast.Name) and target.id in local):
                self.dunder(node, node.args[1].value)  # type: ignore[attr-defined]
                return
            self.refuse(node, "getattr of something other than the module or a value")
        if isinstance(func, ast.Name) and (func.id == "device" or func.id in self.callables):
            for argument in node.args:
                if func.id in self.callables and argument is node.args[0]:
                    self.operator(argument)  # the op the wrapper calls
                else:
                    self.expression(argument, local)
            return
        self.operator(func)
        for argument in node.args:
            self.expression(argument, local)

    def operator(self, func: ast.expr) -> None:
        """`torch.ops.<namespace>.<op>[.<overload>]`, resolving to a torch operator."""
        path = _dotted(func)
        parts = path.split(".") if path else []
        if len(parts) not in (4, 5) or parts[:2] != ["torch", "ops"]:
            self.refuse(func, f"a call of {path or type(func).__name__!r} (only torch.ops "
                              f"operators are called)")
        try:  # operator names may be dunders (aten.__and__): what they resolve to decides
            found: Any = torch.ops
            for part in parts[2:]:
                found = getattr(found, part)
        except (AttributeError, RuntimeError):
            self.refuse(func, f"{path}, which is no operator of this torch")
        if not isinstance(found, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                                  torch._ops.HigherOrderOperator)):
            self.refuse(func, f"{path}, which is no operator")

    def dunder(self, node: ast.AST, name: Any) -> None:
        if not isinstance(name, str) or name.startswith("__"):
            self.refuse(node, f"the name {name!r}")


def _constant(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _constant(node.operand) or (isinstance(node.operand, ast.Name)
                                           and node.operand.id == "inf")
    return False


def _dotted(node: ast.expr) -> str:
    """`a.b.c` for a chain of attributes on a name, else ""."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else ""
    return ""


def _is_getattr(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) == 2 and not node.keywords
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str))
