import pyarrow as pa
import pytest

from sink.delta_log.schema import added_columns, fits
from sink.errors import SchemaError

ROLES = {"id": "key", "dt": "partition_by", "ts": "ordering"}
TABLE = pa.schema([("id", pa.int64()), ("dt", pa.string()), ("ts", pa.timestamp("us", tz="UTC")),
                   ("amount", pa.float64())])


@pytest.mark.parametrize("stream, table, ok", [
    (pa.int32(), pa.int64(), True),  # widening keeps every value (and a key's text form)
    (pa.int64(), pa.int32(), False),
    (pa.float32(), pa.float64(), True),
    (pa.string_view(), pa.string(), True),  # layouts of one logical type
    (pa.string(), pa.int64(), False),  # "0042" would become 42
    (pa.float64(), pa.string(), False),  # 1.0 would become '1'
    (pa.int64(), pa.float64(), False),
    (pa.timestamp("us", tz="UTC"), pa.timestamp("us", tz="UTC"), True),
    (pa.timestamp("us"), pa.timestamp("us", tz="UTC"), False),
])
def test_fits_only_where_no_value_changes(stream, table, ok):
    assert fits(stream, table) is ok


def test_new_stream_columns_are_added_nullable():
    stream = pa.schema([*TABLE, pa.field("note", pa.string(), nullable=False)])
    assert added_columns(stream, TABLE, ROLES, "add_columns") == [pa.field("note", pa.string())]
    with pytest.raises(SchemaError, match=r"column\(s\) \['note'\] the table lacks and schema_evolution = 'fail'"):
        added_columns(stream, TABLE, ROLES, "fail")


def test_a_dropped_column_is_refused_by_name():
    with pytest.raises(SchemaError, match=r"the table's column\(s\) \['amount'\] are not in the stream"):
        added_columns(pa.schema(list(TABLE)[:3]), TABLE, ROLES, "add_columns")


def test_a_retyped_key_or_value_column_is_refused_naming_its_role():
    stream = pa.schema([("id", pa.string()), *list(TABLE)[1:]])
    with pytest.raises(SchemaError, match="key column 'id' is string in the stream and int64 in the table"):
        added_columns(stream, TABLE, ROLES, "add_columns")
    stream = pa.schema([*list(TABLE)[:3], ("amount", pa.string())])
    with pytest.raises(SchemaError, match="^column 'amount' is string in the stream and double in the table"):
        added_columns(stream, TABLE, ROLES, "add_columns")
