"""The configuration reference: SinkConfig's fields (sink.config.options.SinkOptions) with their
docstrings and defaults, written into docs/configuration.md between its markers
(`python -m sink.config.docs` writes it; a test fails when the page and the code differ), so
the page cannot drift from the code."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from sink.config.options import SinkOptions

DEFAULT_PREFIX = "Default: "
PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN, END = "<!-- sink-config-reference -->", "<!-- /sink-config-reference -->"


@dataclass(frozen=True)
class FieldDoc:
    name: str
    doc: str  # its docstring, less a trailing "Default: ..." paragraph
    default: str  # as a TOML value, "required", or what that paragraph says


def field_docs(cls: type = SinkOptions) -> list[FieldDoc]:
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


def reference_table(cls: type = SinkOptions) -> str:
    """The fields as a Markdown table: key, meaning, default."""
    rows = ["| key | meaning | default |", "|---|---|---|"]
    rows += [f"| `{d.name}` | {d.doc} | {d.default} |" for d in field_docs(cls)]
    return "\n".join(rows)


def written(page: str) -> str:
    """`page` with the reference table between its BEGIN and END markers (as of the code now)."""
    if BEGIN not in page or END not in page:
        raise ValueError(f"the page has no {BEGIN} ... {END} block for the reference")
    return re.sub(f"{re.escape(BEGIN)}.*?{re.escape(END)}", lambda _: f"{BEGIN}\n{reference_table()}\n{END}", page,
                  count=1, flags=re.S)


def main() -> None:
    """Write the reference into docs/configuration.md (or the page named)."""
    page = Path(sys.argv[1]) if len(sys.argv) > 1 else PAGE
    page.write_text(written(page.read_text()))


if __name__ == "__main__":
    main()
