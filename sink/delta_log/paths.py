"""Where a file the Delta log names is stored.

The log's paths are URIs. A relative one is under the table's root and percent-encoded, so a
partition directory's own escapes are encoded again (`dt=a%253Ab` is the directory `dt=a%3Ab`).
An absolute one names its own location, outside the table's root: a shallow clone's files
(`file:/...`, `s3a://bucket/...`), a deletion vector stored by path.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

# A scheme, then a slash: "dt=a:b/x" (a colon in a relative path) is not absolute.
_ABSOLUTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")


def is_absolute(path: str) -> bool:
    return bool(_ABSOLUTE.match(path))


def file_location(root: str, path: str) -> str:
    """The file `path` names, on the table's filesystem (`root`: the table's location there,
    as `sink.delta_log.reading.filesystem` gives it)."""
    if not is_absolute(path):
        return f"{root}/{unquote(path)}"
    parts = urlsplit(path)
    if parts.scheme == "file":
        return unquote(parts.path)
    # An object store's file is `bucket/key` to pyarrow (Azure's `container@account`: the container).
    return unquote(parts.netloc.split("@")[0] + parts.path)
