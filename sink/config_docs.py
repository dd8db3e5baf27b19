"""The configuration reference: SinkConfig's fields with their docstrings and defaults, as the
docs site renders it (docs/hooks.py), so the page cannot drift from the code."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import dataclass

from sink.config import SinkConfig

DEFAULT_PREFIX = "Default: "


@dataclass(frozen=True)
class FieldDoc:
    name: str
    doc: str  # its docstring, less a trailing "Default: ..." paragraph
    default: str  # as a TOML value, "required", or what that paragraph says


def field_docs(cls: type = SinkConfig) -> list[FieldDoc]:
    """Every dataclass field of `cls`, in order, with the string literal that follows it in the
    class body (an attribute docstring). A field without one raises ValueError, naming it."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    out = []
    for f in dataclasses.fields(cls):
        if f.name not in docs:
            raise ValueError(f"{cls.__name__}.{f.name} has no docstring: the configuration reference needs one")
        doc, _, stated = docs[f.name].partition("\n" + DEFAULT_PREFIX)
        out.append(FieldDoc(f.name, " ".join(doc.split()), " ".join(stated.split()) or _default(f)))
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return _toml(value)


def _toml(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"`{value}` ({value >> 20} MiB)"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def reference_table(cls: type = SinkConfig) -> str:
    """The fields as a Markdown table: key, meaning, default."""
    rows = ["| key | meaning | default |", "|---|---|---|"]
    rows += [f"| `{d.name}` | {d.doc} | {d.default} |" for d in field_docs(cls)]
    return "\n".join(rows)
