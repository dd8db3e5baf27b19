"""mkdocs hooks: the pages generated from the code and the bench results, so they cannot drift.

- `<!-- sink-config-reference -->` ... `<!-- /sink-config-reference -->`: SinkConfig's fields,
  docstrings and defaults (sink.config.docs, which writes them into the page itself too).
- `<!-- bench-report: <json> -->`: the tables `python -m bench.report <json>` prints.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # mkdocs runs from anywhere: the repo's packages come first

from bench.report import markdown as bench_tables  # noqa: E402
from sink.config.docs import BEGIN as CONFIG_MARKER  # noqa: E402
from sink.config.docs import written  # noqa: E402

BENCH_MARKER = re.compile(r"<!-- bench-report: (\S+) -->")


def on_page_markdown(markdown: str, **_) -> str:
    if CONFIG_MARKER in markdown:
        markdown = written(markdown)
    return BENCH_MARKER.sub(lambda m: bench_tables(json.loads((ROOT / m[1]).read_text())), markdown)
