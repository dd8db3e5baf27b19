"""The configuration page is generated from SinkConfig's field docstrings: every field has one."""

import dataclasses
from dataclasses import dataclass, field

import pytest

from sink.config import SinkConfig
from sink.config.docs import PAGE, field_docs, reference_table, written


def test_every_sink_config_field_is_documented_in_order():
    docs = field_docs()
    assert [d.name for d in docs] == [f.name for f in dataclasses.fields(SinkConfig)]
    assert all(d.doc for d in docs)


def test_defaults_are_shown_as_toml_or_as_the_docstring_states_them():
    docs = {d.name: d for d in field_docs()}
    assert docs["table_uri"].default == "required"
    assert docs["partition_by"].default == "`[]`"
    assert docs["bootstrap_days"].default == "`7`"
    assert docs["ignore_null_updates"].default == "`false`"
    assert docs["scope"].default == '`"partitioned"`'
    assert docs["delete_when"].default == "unset"
    assert docs["file_cache_bytes"].default == "`268435456` (256 MiB)"
    assert docs["writer_id"].default == "derived from the table and the checkpoint."
    assert "Default:" not in docs["writer_id"].doc


@dataclass
class Undocumented:
    a: int
    """Documented."""
    b: list[int] = field(default_factory=list)


def test_a_field_without_a_docstring_is_named():
    with pytest.raises(ValueError, match=r"Undocumented.b has no docstring"):
        field_docs(Undocumented)


def test_the_table_has_a_row_per_field():
    rows = reference_table().splitlines()
    assert len(rows) == 2 + len(dataclasses.fields(SinkConfig))
    assert rows[2].startswith("| `table_uri` | Delta table (path or URI)")


def test_the_configuration_page_holds_the_reference_as_the_code_gives_it():
    """docs/configuration.md itself, not only the site, holds the table: regenerate it with
    `python -m sink.config.docs` after changing a field."""
    page = PAGE.read_text()
    assert reference_table() in page
    assert written(page) == page
