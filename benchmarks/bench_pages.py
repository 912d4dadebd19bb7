"""One FusedRNMTDecoder option on against off, in one process: the weights in 2 MiB pages (`huge_pages`) or the
tables the search's steps read instead of recomputing their products (`step_tables`: the context's products made
once per sentence, the keys' exponentials and the previous token's products) or the per-head matrices of the
context the decoder makes once for those products (`context_table`), or the previous token's tables (token and
position products) in 2 MiB pages against 4 KiB ones (`table_pages`), or the encoder's recurrent matrices in the
row-panel layout for batch 1 (`encoder_panels`), or the encoder's input products read from tables of the source
embedding instead of computed (`source_tables`), or the attention's output projection folded into the two matrices
that read the context (`fold`): the switches of dtmt_models.engine.EngineOptions and two of their parts (why each:
docs/design/decoding.md, "Engine options" and "Tables made once per model and per sentence";
docs/design/cpu_kernels.md, "Weights on 2 MiB pages" and "Row panels"); or, with one decoder, the search's stopping
rule checked against the one translation written (`nbest_stop`: nbest 1) against the beam's worst finished one
(nbest 4, the rule before; docs/design/decoding.md, "Beam search").

    python benchmarks/bench_pages.py --checkpoint benchmarks/out/dev_dtmt/best.pt --threads 1 --chunk 1 --sentences 150
    python benchmarks/bench_pages.py --checkpoint benchmarks/out/dev_dtmt/best.pt --threads 2 --chunk 60
    python benchmarks/bench_pages.py --option step_tables --threads 1 --chunk 1 --sentences 300
    python benchmarks/bench_pages.py --option context_table --threads 1 --chunk 1 --sentences 400
    python benchmarks/bench_pages.py --option table_pages --threads 1 --chunk 1 --sentences 400
    python benchmarks/bench_pages.py --option encoder_panels --threads 1 --chunk 1 --sentences 400
    python benchmarks/bench_pages.py --option nbest_stop --threads 1 --chunk 1 --sentences 400
    python benchmarks/bench_pages.py --option source_tables --threads 1 --chunk 1 --sentences 400
    python benchmarks/bench_pages.py --option fold --threads 1 --chunk 1 --sentences 400

Builds both decoders in one process (FusedRNMTDecoder with --option True, the default, and False) and translates
the first --sentences test sources (beam 4) in chunks of --chunk sentences (1: one sentence a call, batch 1; more:
`translate`'s batching by tokens within the chunk), each chunk by both decoders, the order swapped from one chunk
to the next, so that the VM's drifting speed falls on both alike. Prints the seconds of each (model load
excluded), their ratio and how many translations differ (huge_pages, table_pages: none may; step_tables: the same
sums in another order, so a near-tie may go the other way; encoder_panels likewise at batch 1, source_tables and
fold at any batch; nbest_stop: none
may at --chunk 1, the best being the same by construction, while in chunks a sentence's batch changes as others
end sooner, so a near-tie may go the other way). With huge_pages / table_pages the line names the
system's transparent huge page setting: under `always` an ordinary allocation may be in 2 MiB pages too.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)


def transparent_huge_pages() -> str:
    """The system's setting (/sys/kernel/mm/transparent_hugepage/enabled: `madvise` or `never` leave ordinary
    allocations in 4 KiB pages, `always` may put them in 2 MiB ones too), or "unknown"."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else "unknown"


DEFAULT_CHECKPOINT = os.path.join(HERE, "out", "dev_dtmt", "best.pt")


def main(argv=None):
    import torch
    from common import machine_name, torch_threads

    from dtmt_models.data.corpus import corpus_paths, read_parallel
    from dtmt_models.decoding.translate import translate
    from dtmt_models.models.checkpoint import load_model
    from dtmt_models.engine.rnmt import FusedRNMTDecoder

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bible"))
    p.add_argument("--sentences", type=int, default=0, help="the first N test sources (0: all)")
    p.add_argument("--chunk", type=int, default=1, help="sentences a call (1: batch 1)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--int8", action="store_true", help="int8 decoders (`dtmt translate --int8`)")
    p.add_argument("--option", choices=("huge_pages", "step_tables", "context_table", "table_pages", "encoder_panels",
                                        "source_tables", "fold", "nbest_stop"),
                   default="huge_pages",
                   help="the FusedRNMTDecoder option timed on against off (context_table: the decoder's attribute, "
                        "set to None in the other decoder; table_pages: the other decoder's token and position "
                        "tables copied into ordinary 4 KiB pages; nbest_stop: one decoder, searched with nbest 1 "
                        "and 4, the first translation of each kept)")
    a = p.parse_args(argv)
    from common import DEV_DTMT_MADE_BY, check_checkpoint, check_options

    check_options(p, a, (("sentences", 0), ("chunk", 1), ("threads", 1)))
    # (a missing checkpoint, the default one of a local run above all, or corpus was a traceback)
    check_checkpoint(p, a.checkpoint, DEFAULT_CHECKPOINT, DEV_DTMT_MADE_BY)
    try:
        test = corpus_paths(a.data, "test")
    except ValueError as exc:   # (CorpusError)
        p.error(f"--data {a.data}: {exc}")
    model, sv, tv, ckpt = load_model(a.checkpoint)
    model.eval()
    sources = [s for s, _ in read_parallel(*test)]
    sources = sources[:a.sentences] if a.sentences else sources
    with torch_threads(a.threads), torch.no_grad():
        on = model.inference_decoder(int8=a.int8)
        if not isinstance(on, FusedRNMTDecoder):
            raise SystemExit(f"{a.checkpoint}: {ckpt['model_name']} has no fused decoder")
        if a.option == "context_table":   # an attribute made once, not a constructor option
            off = on.variant()
            if on.context_table is None:
                raise SystemExit(f"{a.checkpoint}: its decoder makes no context_table")
            off.context_table = None
        elif a.option == "table_pages":   # the same tables, in the 4 KiB pages of an ordinary allocation
            if on.token_table is None:
                raise SystemExit(f"{a.checkpoint}: its decoder makes no token table (int8 weights, or a system "
                                 f"whose search embeds otherwise)")
            off = on.variant()
            # from here on its tables (a position table made longer too) stay ordinary
            off.options = replace(off.options, huge_pages=False)
            off.token_table, off._position_table = off.token_table.clone(), None
        elif a.option == "source_tables" and on.source_table is None:
            raise SystemExit(f"{a.checkpoint}: its decoder has no source tables (int8, a table past its size bound, "
                             f"or a system that encodes otherwise): both decoders would be the same")
        elif a.option == "nbest_stop":   # one decoder; the rule is the search's (its nbest)
            off = on
        else:
            off = on.variant(options=replace(on.options, **{a.option: False}))
        decoders = ({"2 MiB pages": on, "4 KiB pages": off} if a.option in ("huge_pages", "table_pages") else
                    {"nbest 1": on, "nbest 4": off} if a.option == "nbest_stop" else
                    {f"{a.option}=True": on, f"{a.option}=False": off})
        names = list(decoders)
        # each decoder's nbest: 1 (translate's default) but for nbest_stop's second, the previous rule's 4
        nbest = {"nbest 1": 1, "nbest 4": 4} if a.option == "nbest_stop" else dict.fromkeys(names, 1)
        for name, d in decoders.items():   # a first call out of the timing
            translate(model, sv, tv, sources[:1], beam=4, nbest=nbest[name], decoder=d)
        seconds = dict.fromkeys(names, 0.0)
        hyps = {name: [] for name in names}
        for i in range(0, len(sources), a.chunk):
            for name in names if (i // a.chunk) % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                out = translate(model, sv, tv, sources[i:i + a.chunk], beam=4, nbest=nbest[name],
                                decoder=decoders[name])
                seconds[name] += time.perf_counter() - t0
                hyps[name] += [h[0][0] for h in out]
    differ = sum(x != y for x, y in zip(hyps[names[0]], hyps[names[1]]))
    machine = machine_name(threads=False)   # named below
    if a.option in ("huge_pages", "table_pages"):   # an ordinary allocation is in 4 KiB pages only under these
        machine += f"; transparent huge pages: {transparent_huge_pages()}"
    print(f"{machine}; {os.path.relpath(a.checkpoint, ROOT)}{' int8' if a.int8 else ''}; {len(sources)} "
          f"sentences, {a.chunk} a call, {a.threads} thread(s): " +
          ", ".join(f"{n} {s:.2f} s" for n, s in seconds.items()) +
          f"; ratio {seconds[names[0]] / seconds[names[1]]:.3f}; translations that differ: {differ}")
    return seconds, differ


if __name__ == "__main__":
    main()
