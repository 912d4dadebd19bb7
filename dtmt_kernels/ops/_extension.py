"""The compiled extension, dtmt_kernels._C, loaded once: importing it registers the C++ ops (csrc/registration.cpp,
torch.ops.dtmt.*). Its absence is reported by dtmt_kernels.available_backends(), never hidden."""
from __future__ import annotations

from typing import Optional

try:  # built by setup.py
    from .. import _C  # type: ignore[attr-defined]
    IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    _C = None
    IMPORT_ERROR = exc


def built() -> bool:
    """Whether the extension (and so the C++ ops) loaded."""
    return _C is not None
