"""A small Go-template renderer for the chart's templates, so tests can render them without helm.

It implements the subset of Go's text/template and Helm's functions the chart uses: trim markers,
comments, ``define``/``include``, ``if``/``else``/``else if``, ``with``, ``range`` (with one or two
variables), ``$var :=``, pipelines with parentheses and field access on their result, and the Sprig
functions listed in ``FUNCTIONS``. Field access on a missing map gives nil and on nil fails, as
Helm does; ``fail`` raises :class:`TemplateFailError`. Anything else raises :class:`TemplateError`, so a
template using more than this renderer knows fails loudly instead of rendering wrong.

It is a test aid, not Helm: ``scripts/helm-check.sh`` renders with the real helm where it exists.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class TemplateError(Exception):
    """The template uses something this renderer does not implement, or is malformed."""


class TemplateFailError(Exception):
    """The template called ``fail`` (Helm stops the install with this message)."""


_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)


@dataclass
class _Node:
    kind: str  # text, output, if, with, range, define
    text: str = ""
    branches: list[tuple[str | None, list[_Node]]] = field(default_factory=list)  # (condition, body)


def _tokens(source: str) -> list[tuple[str, str]]:
    """("text", s) and ("action", s) with the trim markers applied to the text around them."""
    out: list[tuple[str, str]] = []
    pos = 0
    trim_next = False
    for match in _ACTION.finditer(source):
        text = source[pos:match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1):
            text = text.rstrip()
        out.append(("text", text))
        out.append(("action", match.group(2).strip()))
        trim_next = bool(match.group(3))
        pos = match.end()
    tail = source[pos:]
    out.append(("text", tail.lstrip() if trim_next else tail))
    return out


def _parse(tokens: list[tuple[str, str]], defines: dict[str, list[_Node]]) -> list[_Node]:
    stack: list[tuple[_Node, list[_Node]]] = []
    root: list[_Node] = []
    body = root
    for kind, text in tokens:
        if kind == "text":
            if text:
                body.append(_Node("text", text))
            continue
        if text.startswith("/*"):
            continue
        word = text.split(None, 1)[0] if text else ""
        rest = text[len(word):].strip()
        if word in ("if", "with", "range", "define"):
            node = _Node(word)
            node.branches.append((rest, []))
            body.append(node)
            stack.append((node, body))
            body = node.branches[-1][1]
        elif word == "else":
            if not stack:
                raise TemplateError("else without if")
            node = stack[-1][0]
            condition = rest[3:].strip() if rest.startswith("if ") else None
            node.branches.append((condition, []))
            body = node.branches[-1][1]
        elif word == "end":
            if not stack:
                raise TemplateError("end without a block")
            node, body = stack.pop()
            if node.kind == "define":
                body.remove(node)
                defines[_string(node.branches[0][0] or "")] = node.branches[0][1]
        else:
            body.append(_Node("output", text))
    if stack:
        raise TemplateError(f"unclosed {stack[-1][0].kind}")
    return root


def _string(literal: str) -> str:
    if not (literal.startswith('"') and literal.endswith('"')):
        raise TemplateError(f"expected a string literal, got {literal!r}")
    value: str = json.loads(literal)
    return value


def truthy(value: Any) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, (int, float, str, list, dict, tuple)):
        return bool(value)
    return True


def _go_string(value: Any) -> str:
    if value is None:
        return ""
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (dict, list)):
        raise TemplateError(f"printing a {type(value).__name__} (use toYaml)")
    return str(value)


def _printf(fmt: str, *args: Any) -> str:
    out, i = [], 0
    parts = re.split(r"(%[sdvq%])", fmt)
    for part in parts:
        if part == "%%":
            out.append("%")
        elif part in ("%s", "%v", "%d"):
            out.append(_go_string(args[i]))
            i += 1
        elif part == "%q":
            out.append(json.dumps(_go_string(args[i])))
            i += 1
        else:
            out.append(part)
    return "".join(out)


def _indent(spaces: int, text: str) -> str:
    pad = " " * int(spaces)
    return "\n".join(pad + line for line in str(text).split("\n"))


def _to_yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=False, sort_keys=True).rstrip("\n").removesuffix("\n...")


def _fail(message: str) -> str:
    raise TemplateFailError(message)


def _default(default: Any, value: Any = None) -> Any:
    return value if truthy(value) else default


def _and(*values: Any) -> Any:
    for value in values:
        if not truthy(value):
            return value
    return values[-1]


def _or(*values: Any) -> Any:
    for value in values:
        if truthy(value):
            return value
    return values[-1]


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "printf": _printf, "print": lambda *a: "".join(_go_string(x) for x in a),
    "quote": lambda *a: " ".join(json.dumps(_go_string(x)) for x in a),
    "int": lambda v: int(float(v or 0)), "default": _default,
    "dict": lambda *a: dict(zip(a[::2], a[1::2], strict=True)),
    "and": _and, "or": _or, "not": lambda v: not truthy(v), "eq": lambda a, *b: any(a == x for x in b),
    "lt": lambda a, b: a < b, "add": lambda *a: sum(int(x) for x in a), "ceil": lambda v: float(math.ceil(float(v))),
    "trunc": lambda n, s: s[:n], "trimSuffix": lambda suffix, s: s.removesuffix(suffix),
    "lower": lambda s: str(s).lower(), "contains": lambda sub, s: sub in s, "dir": posixpath.dirname,
    "nindent": lambda n, s: "\n" + _indent(n, s), "indent": _indent, "toYaml": _to_yaml,
    "fromYaml": lambda s: yaml.safe_load(s) or {}, "get": lambda d, k: (d or {}).get(k, ""),
    "sha256sum": lambda s: hashlib.sha256(str(s).encode()).hexdigest(), "fail": _fail,
}


class Chart:
    """The chart's templates; :meth:`render` one file or :meth:`include` one define."""

    def __init__(self, directory: Path, *, name: str = "region-agent", version: str = "0.1.0",
                 app_version: str = "0.1.0") -> None:
        self.directory = directory
        self.defines: dict[str, list[_Node]] = {}
        self.chart = {"Name": name, "Version": version, "AppVersion": app_version}
        for helper in sorted((directory / "templates").glob("_*.tpl")):
            _parse(_tokens(helper.read_text()), self.defines)
        for template in sorted((directory / "templates").glob("*.yaml")):  # include (print $.Template.BasePath ...)
            self.defines[f"{name}/templates/{template.name}"] = _parse(_tokens(template.read_text()), {})

    def context(self, values: dict[str, Any], *, release: str = "ra", namespace: str = "dns") -> dict[str, Any]:
        return {"Values": values, "Chart": self.chart,
                "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
                "Template": {"BasePath": "region-agent/templates"}}

    def render(self, template: str, dot: dict[str, Any]) -> str:
        nodes = _parse(_tokens((self.directory / "templates" / template).read_text()), dict(self.defines))
        return self._nodes(nodes, dot, {"$": dot})

    def include(self, name: str, dot: Any) -> str:
        if name not in self.defines:
            raise TemplateError(f"no template {name!r}")
        return self._nodes(self.defines[name], dot, {"$": dot})

    # --- evaluation -------------------------------------------------------------------------

    def _nodes(self, nodes: list[_Node], dot: Any, variables: dict[str, Any]) -> str:
        out: list[str] = []
        for node in nodes:
            if node.kind == "text":
                out.append(node.text)
            elif node.kind == "output":
                out.append(self._statement(node.text, dot, variables))
            elif node.kind == "if":
                for condition, body in node.branches:
                    if condition is None or truthy(self._pipeline(condition, dot, variables)):
                        out.append(self._nodes(body, dot, dict(variables)))
                        break
            elif node.kind == "with":
                condition, body = node.branches[0]
                value = self._pipeline(condition or "", dot, variables)
                if truthy(value):
                    out.append(self._nodes(body, value, dict(variables)))
                elif len(node.branches) > 1:
                    out.append(self._nodes(node.branches[1][1], dot, dict(variables)))
            elif node.kind == "range":
                out.append(self._range(node, dot, variables))
        return "".join(out)

    def _statement(self, text: str, dot: Any, variables: dict[str, Any]) -> str:
        match = re.fullmatch(r"(\$\w+)\s*:?=\s*(.*)", text, re.S)
        if match:
            variables[match.group(1)] = self._pipeline(match.group(2), dot, variables)
            return ""
        return _go_string(self._pipeline(text, dot, variables))

    def _range(self, node: _Node, dot: Any, variables: dict[str, Any]) -> str:
        spec = node.branches[0][0] or ""
        match = re.fullmatch(r"(?:(\$\w+)\s*(?:,\s*(\$\w+))?\s*:=\s*)?(.*)", spec, re.S)
        assert match is not None
        first, second, pipeline = match.groups()
        collection = self._pipeline(pipeline, dot, variables)
        items = sorted(collection.items()) if isinstance(collection, dict) else list(enumerate(collection or []))
        out = []
        for key, value in items:
            scope = dict(variables)
            if first and second:
                scope[first], scope[second] = key, value
            elif first:
                scope[first] = value
            out.append(self._nodes(node.branches[0][1], value, scope))
        return "".join(out)

    def _pipeline(self, text: str, dot: Any, variables: dict[str, Any]) -> Any:
        value: Any = _NOTHING
        for command in _split(text, "|"):
            args = _split(command.strip(), " ")
            if value is not _NOTHING:
                args.append(_Evaluated(value))
            value = self._command(args, dot, variables)
        return value

    def _command(self, args: list[Any], dot: Any, variables: dict[str, Any]) -> Any:
        head = args[0]
        if isinstance(head, str) and head in ("include", "template"):
            name = self._operand(args[1], dot, variables)
            return self.include(name, self._operand(args[2], dot, variables))
        if isinstance(head, str) and head in FUNCTIONS:
            return FUNCTIONS[head](*(self._operand(a, dot, variables) for a in args[1:]))
        if len(args) != 1:
            raise TemplateError(f"unknown function {head!r}")
        return self._operand(head, dot, variables)

    def _operand(self, token: Any, dot: Any, variables: dict[str, Any]) -> Any:
        if isinstance(token, _Evaluated):
            return token.value
        if token.startswith("("):
            close = _closing(token)
            value = self._pipeline(token[1:close], dot, variables)
            return _fields(value, token[close + 1:])
        if token.startswith('"'):
            return _string(token)
        if token in ("true", "false"):
            return token == "true"
        if token == "nil":
            return None
        if re.fullmatch(r"-?\d+", token):
            return int(token)
        if token.startswith("$"):
            name, _, rest = token.partition(".")
            if name not in variables:
                raise TemplateError(f"undefined variable {name}")
            return _fields(variables[name], "." + rest if rest else "")
        if token.startswith("."):
            return _fields(dot, token if token != "." else "")
        if token in FUNCTIONS:
            return FUNCTIONS[token]()
        raise TemplateError(f"unknown operand {token!r}")


class _Evaluated:
    def __init__(self, value: Any) -> None:
        self.value = value


_NOTHING = object()


def _fields(value: Any, path: str) -> Any:
    for name in [p for p in path.split(".") if p]:
        if value is None:
            raise TemplateError(f"nil pointer evaluating .{name}")
        if not isinstance(value, dict):
            raise TemplateError(f"can not evaluate .{name} on a {type(value).__name__}")
        value = value.get(name)
    return value


def _closing(text: str) -> int:
    depth = 0
    in_string = False
    for i, char in enumerate(text):
        if in_string:
            if char == "\\":
                continue
            if char == '"' and text[i - 1] != "\\":
                in_string = False
        elif char == '"':
            in_string = True
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                return i
    raise TemplateError(f"unbalanced parentheses in {text!r}")


def _split(text: str, separator: str) -> list[Any]:
    """Split on ``separator`` outside strings and parentheses (and drop empty pieces for spaces)."""
    parts, current, depth, in_string, i = [], [], 0, False, 0
    while i < len(text):
        char = text[i]
        if in_string:
            current.append(char)
            if char == "\\" and i + 1 < len(text):
                current.append(text[i + 1])
                i += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
            current.append(char)
        elif char == "(":
            depth += 1
            current.append(char)
        elif char == ")":
            depth -= 1
            current.append(char)
        elif depth == 0 and (char == separator or (separator == " " and char in " \t\n")):
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
        i += 1
    parts.append("".join(current))
    return [p for p in parts if p.strip()] if separator == " " else parts
