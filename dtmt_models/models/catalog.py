"""`dtmt models`: the registered systems and the papers' table rows that build as presets (contract §6).

    dtmt models                 systems, their presets, and every paper row with the paper's parameter count
    dtmt models --count         ... and ours at the paper's sizes (built on the meta device: nothing allocated)
    dtmt models --table 002-T4  one table only
"""
from __future__ import annotations

import inspect
from typing import Dict, List, Optional

import torch

from dtmt_models.models.presets import PAPER_ROWS, TABLES, PaperRow, presets_of
from dtmt_models.models.registry import _MODELS, build_model, list_models, shapes_only


def _row_model(row: PaperRow) -> torch.nn.Module:
    vocab = TABLES[row.table].vocab
    with shapes_only():   # (nothing allocated at the papers' sizes)
        return build_model(row.model, vocab, vocab, **row.options)


def row_parameters(row: PaperRow) -> int:
    """Our parameter count for a paper row at the paper's sizes and its table's vocabulary (per side)."""
    return sum(p.numel() for p in _row_model(row).parameters())


def layout_parameters(row: PaperRow) -> int:
    """The parameters the paper's own implementation keeps for a row beyond ours, the same model in another
    layout: what its count includes that ours folds away. Paper 002 counts Nematus' GRUs, whose layer norm
    normalises the input's and the state's products apart (gates and proposal, a gain and an offset each) and keeps
    the biases too: 15H a GRU with an input (ours, per-gate layer norm of contract §2 with the gates' biases in its
    offsets: 6H), 9H a transition GRU (ours 5H); without layer norm it keeps one bias a gate, 3H (ours 6H with an
    input, torch's two biases, and 3H without). Counted from our model, cell by cell and direction by direction
    (Nematus' count less our biases, gains and offsets); negative where ours has more. 0 for other papers' rows."""
    if row.model != "nematus" or not row.table.startswith("002-"):
        return 0
    params = dict(_row_model(row).named_parameters())
    extra = 0
    for name, w in params.items():
        if "weight_hh" not in name:   # one recurrent cell (a direction of a layer, or a T-GRU) per recurrent matrix
            continue
        prefix, suffix = name.split("weight_hh")
        here = {k: params.get(prefix + k + suffix) for k in ("weight_ih", "bias_ih", "bias_hh", "ln_weight", "ln_bias")}
        ours = sum(t.numel() for k, t in here.items() if t is not None and k != "weight_ih")
        H = w.shape[1]
        if here["ln_weight"] is None:
            extra += 3 * H - ours
        else:
            extra += (15 if here["weight_ih"] is not None else 9) * H - ours
    return extra


def _paper_count(row: PaperRow) -> str:
    if row.params is None:
        return "BLEU only"
    return f"{row.params:,}" if row.params >= 1e6 else f"{row.params:.1f} M"


def _millions(n: float) -> float:
    return n / 1e6 if n >= 1e6 else n


def describe(count: bool = False, table: Optional[str] = None) -> str:
    lines: List[str] = []
    if table is None:
        lines.append("systems (dtmt train --model NAME --preset PRESET):")
        for name in list_models():
            doc = inspect.getmodule(_MODELS[name]).__doc__ or ""
            first = doc.strip().splitlines()[0] if doc.strip() else ""
            lines.append(f"  {name:<14s} {first}")
            rows = sum(r.model == name for r in PAPER_ROWS)
            lines.append(f"  {'':<14s} presets: {', '.join(p for p in presets_of(name) if p in ('small', 'paper'))}"
                         + (f", and {rows} paper table row{'s' if rows > 1 else ''} (below)" if rows else ""))
        lines.append("")
        lines.append("the papers' table rows (a row is a preset of its system: dtmt train --preset ROW, the model "
                     "follows from the row):")
    for key, t in TABLES.items():
        if table is not None and key != table:
            continue
        rows = [r for r in PAPER_ROWS if r.table == key]
        layout = "; ours in Nematus' layer-norm layout" if key.startswith("002-") else ""
        lines.append(f"{t.title} (counts at {t.vocab:,} subwords per side{layout if count else ''})")
        base: Dict[str, float] = {}
        for r in rows:
            line = f"  {r.name:<27s} {r.model:<14s} {r.label:<58s} {_paper_count(r):>12s}"
            if count and r.params is not None:
                built = row_parameters(r)
                ours = built + layout_parameters(r)   # (in the paper's layout: same model)
                if not base:
                    base = dict(paper=_millions(r.params), ours=ours / 1e6)
                line += (f"   ours {ours / 1e6:8.3f} M   Δ paper {_millions(r.params) - base['paper']:+8.3f}"
                         f"  Δ ours {ours / 1e6 - base['ours']:+8.3f}")
                if ours != built:   # (the figure dtmt train logs is the model's own count: said beside it)
                    line += f"   (built: {built / 1e6:.3f} M, as dtmt train counts)"
            lines.append(line)
            if r.unmatched:
                lines.append(f"  {'':<27s} count not reproduced: {r.unmatched}")
        lines.append("")
    return "\n".join(lines).rstrip()
