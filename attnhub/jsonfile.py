"""Writing JSON files atomically: results, cost tables and measurements are read by other
processes, which must never see half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["write_json"]


def write_json(data: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``data`` to ``path`` atomically (a temporary file beside it, then a rename).

    Where either step fails (a full disk, ``path`` a directory), the temporary file is
    removed and the error raised: ``path`` is as it was, and nothing is left beside it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
