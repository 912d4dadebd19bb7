"""The one plotting setup of the package: matplotlib's Agg canvas used directly (no display, no change to pyplot's
global backend), imported only when a figure is drawn, and figures written atomically.

    fig = figure(7, 4, what="the learning curve")   # None (and a RuntimeWarning) without matplotlib
    ax = fig.add_subplot(1, 1, 1); ...
    save(fig, "curve.png")
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

from dtmt_models.atomic import atomic_path


def figure(width: float, height: float, what: Optional[str] = None, dpi: int = 100):
    """A matplotlib Figure of width x height inches on an Agg canvas. Without matplotlib: ImportError, or, when
    `what` names the plot, None with a RuntimeWarning that it is skipped."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        if what is None:
            raise
        warnings.warn(f"matplotlib is not installed: {what} is skipped", RuntimeWarning, stacklevel=2)
        return None
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def save(fig, path: str, dpi: Optional[int] = None, tight: bool = False) -> str:
    """Writes `fig` to `path` atomically, in the format of its extension (png when it has none); returns path."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    with atomic_path(path, "." + ext) as tmp:
        fig.savefig(tmp, format=ext, dpi=dpi, bbox_inches="tight" if tight else None)
    return path
