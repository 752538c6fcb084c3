"""Files kept while their key holds: what batchlab stored against the inputs that made it (a sweep's
throughput table, an experiment's result row, its exact noise figures, a seed's local-CBS points,
the sweep's state, the prepared data) is read back only when the key it was written under is the
one asked for now; otherwise the caller computes it again and stores it under the new key. The one
way every such file is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read(path: Path, key: str, field: str = "key") -> dict[str, Any] | None:
    """`path`'s JSON object when its `field` holds `key`; None when there is no file, or it is
    another key's (other params, data or code made it)."""
    if not path.is_file():
        return None
    content = json.loads(path.read_text())
    return content if isinstance(content, dict) and content.get(field) == key else None
