"""Where the data directories (`configs/`, `tuning_db/`) live.

In a source checkout or an editable install they sit at the top of the repository; a built wheel
carries them as `tileops/_data/<name>` (see `[tool.setuptools]` in pyproject.toml).
"""

from __future__ import annotations

import functools
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


@functools.cache
def data_dir(name: str) -> Path:
    """The directory `configs` or `tuning_db`, wherever this installation put it."""
    for candidate in (_PACKAGE / "_data" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"tileops data directory {name!r} not found next to {_PACKAGE}")
