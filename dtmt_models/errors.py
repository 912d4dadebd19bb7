"""How the package turns an exception from a library (torch, SentencePiece, the OS) into its own one-line
messages."""
from __future__ import annotations


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its lines joined with " | "; the type's name if it has none)."""
    text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text or type(exc).__name__
