"""Whether triton kernels decorated now would run in triton's CPU interpreter (TRITON_INTERPRET set): a leaf module,
read by the backend registry (dtmt_kernels/backends.py) and the Triton launchers (ops/transition/triton.py) alike,
so that neither imports the other."""
import os


def triton_interpreting() -> bool:
    """Whether triton kernels decorated now would run in triton's CPU interpreter (TRITON_INTERPRET set)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
