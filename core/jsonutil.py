"""JSON for the ``*_json`` evidence columns: compact, NaN-free, stable."""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any


def json_safe(x: Any) -> Any:
    """JSON-safe copy: NaN and infinities -> None, numpy scalars -> Python, tuples -> lists, keys -> str."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def dumps(obj: Any) -> str:
    """JSON for the *_json evidence columns: compact, NaN-free (NaN -> null), stable key order."""
    return json.dumps(json_safe(obj), sort_keys=True, separators=(",", ":"), default=_json_default,
                      allow_nan=False)


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
