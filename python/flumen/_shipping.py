"""How a Python model or function travels to flumen's worker processes.

``pack`` (in the driver, when the function is registered) pickles the class or function
with cloudpickle, beside the driver's ``sys.path``; ``unpack`` (in a worker started as
``python -m flumen worker``, once per function) puts the driver's path entries the worker
lacks at the end of its own, so modules the class refers to by name import there too, and
unpickles it. Unpickling runs code: workers take packed functions only from callers that
hold their driver's secret.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any, Optional


def pack(spec: dict[str, Any]) -> bytes:
    """``spec`` (``kind``, ``object``, ``returns``, ...) as bytes a worker unpacks."""
    import cloudpickle

    return pickle.dumps({"path": list(sys.path), "spec": cloudpickle.dumps(spec)}, protocol=5)


def try_pack(spec: dict[str, Any]) -> tuple[Optional[bytes], Optional[str]]:
    """``pack(spec)``, or why it cannot be packed (then it runs in the driver only)."""
    try:
        return pack(spec), None
    except ImportError:
        return None, "cloudpickle is not installed (pip install cloudpickle)"
    except Exception as e:  # noqa: BLE001 - whatever pickling raises, it stays home
        return None, f"it cannot be pickled: {type(e).__name__}: {e}"


def unpack(packed: bytes) -> dict[str, Any]:
    """The spec ``pack`` made."""
    outer = pickle.loads(packed)
    for entry in outer["path"]:
        if entry not in sys.path:
            sys.path.append(entry)
    return pickle.loads(outer["spec"])
