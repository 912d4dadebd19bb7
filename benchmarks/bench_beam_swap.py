"""Times `translate` on a test set with this checkout's beam search or with another version of beam_search.py
(before/after figures of a beam-search change; those kept: docs/design/decoding.md, "Beam search").

    git show 7bedfeb^:dtmt_models/decoding/beam_search.py > /tmp/beam_search_old.py
    farm-bench -n 4 --vs "python benchmarks/bench_beam_swap.py --beam-search /tmp/beam_search_old.py" -- \\
        python benchmarks/bench_beam_swap.py
    python benchmarks/bench_beam_swap.py --batch-one 300 --threads 1     # one sentence a call
    python benchmarks/bench_beam_swap.py --batch-one 150 --threads 1 --profile \
        --checkpoint benchmarks/out/peers_30m_b/dtmt/best.pt                # where the time goes

Prints one line: which beam search, the decoding seconds (model load excluded) and a SHA-1 of the outputs, so
that two versions can be checked to translate identically.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import hashlib
import importlib.util
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)


def main(argv=None):
    import dtmt_models.decoding.translate as tr

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=os.path.join(HERE, "out", "peers_30m_b", "dtmt", "step_0001734.pt"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bible"))
    p.add_argument("--beam-search", help="a beam_search.py to use instead of this checkout's")
    p.add_argument("--batch-one", type=int, default=0, metavar="N",
                   help="the first N test sources one at a time (default: all, batched by translate)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--int8", action="store_true", help="decode with int8 weight matrices (`dtmt translate --int8`)")
    p.add_argument("--profile", action="store_true", help="decode under cProfile and print the 25 costliest calls")
    p.add_argument("--python-loop", action="store_true",
                   help="beam search's Python loop over the decoder's steps, not its one-call C++ search")
    p.add_argument("--no-fold", action="store_true",
                   help="keep the attention's output projection as a third matrix (EngineOptions fold=False)")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="leave the step's weights where they are, in 4 KiB pages (EngineOptions huge_pages=False)")
    a = p.parse_args(argv)
    ours = tr.beam_search
    try:
        return _run(a, tr)
    finally:
        tr.beam_search = ours   # called from the tests: the process goes on with this checkout's


def _run(a, tr):
    import torch
    from bench_cells import torch_threads

    from dtmt_models.data.corpus import corpus_paths, read_parallel
    from dtmt_models.models.checkpoint import load_model
    from dtmt_models.engine import EngineOptions
    from dtmt_models.models.rnmt import FusedRNMTDecoder

    if a.beam_search:
        spec = importlib.util.spec_from_file_location("swapped_beam_search", a.beam_search)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module   # its dataclass looks its module up there
        spec.loader.exec_module(module)
        tr.beam_search = module.beam_search
    if a.python_loop:
        tr.beam_search = functools.partial(tr.beam_search, fused=False)
    model, sv, tv, _ = load_model(a.checkpoint)
    model.eval()
    sources = [s for s, _ in read_parallel(*corpus_paths(a.data, "test"))]
    profiler = cProfile.Profile() if a.profile else contextlib.nullcontext()
    with torch_threads(a.threads), torch.no_grad():
        decoder = model.inference_decoder(int8=a.int8)   # built once, as `dtmt translate` does
        if (a.no_fold or a.no_huge_pages) and isinstance(decoder, FusedRNMTDecoder):
            decoder = FusedRNMTDecoder(decoder.prepared, decoder.layered, decoder.int8,
                                       EngineOptions(fold=not a.no_fold, huge_pages=not a.no_huge_pages))
        if a.batch_one:   # a first call out of the timing
            tr.translate(model, sv, tv, sources[:1], beam=4, decoder=decoder)
        t0 = time.perf_counter()
        with profiler:
            if a.batch_one:
                hyps = [tr.translate(model, sv, tv, [s], beam=4, decoder=decoder)[0][0][0]
                        for s in sources[:a.batch_one]]
            else:
                hyps = [h[0][0] for h in tr.translate(model, sv, tv, sources, beam=4, decoder=decoder)]
        seconds = time.perf_counter() - t0
    if a.profile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    digest = hashlib.sha1("\n".join(hyps).encode()).hexdigest()[:12]
    which = " ".join([a.beam_search or "this checkout"] + ["python loop"] * a.python_loop + ["no fold"] * a.no_fold
                     + ["4 KiB pages"] * a.no_huge_pages)
    print(f"{which}: {len(hyps)} sentences in {seconds:.2f}s, outputs sha1 {digest}")
    return seconds, hyps


if __name__ == "__main__":
    main()
