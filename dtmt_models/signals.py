"""The commands' signal handlers taken and given back in one way (dtmt train, serve and prepare)."""
from __future__ import annotations

import signal
from typing import Callable, Dict, Iterable


def take_signals(signals: Iterable[int], handler: Callable) -> Dict[int, object]:
    """`handler` for each of `signals`, except one ignored from the start (SIG_IGN: a non-interactive shell starts a
    job with & so, and a Ctrl-C meant for another job is not for it) or handled outside Python (getsignal's None,
    which could not be put back), and except in a thread other than the main one, where Python takes none. Returns
    {signal: the handler replaced} for those taken, for give_back."""
    taken = {}
    for sig in signals:
        if signal.getsignal(sig) in (signal.SIG_IGN, None):
            continue
        try:
            taken[sig] = signal.signal(sig, handler)
        except ValueError:   # not the main thread
            pass
    return taken


def give_back(taken: Dict[int, object]) -> None:
    """The handlers that take_signals replaced, put back."""
    for sig, handler in taken.items():
        signal.signal(sig, handler)
