"""The systems at the papers' own sizes (issue 26): the parameter-count differences of the papers' tables, every
parameter of every preset and paper row trained, every configuration under two-process DDP, the schedules' n."""
import itertools
import os
import subprocess
import sys

import pytest
import torch

from dtmt_models.models.catalog import describe, layout_parameters, row_parameters
from dtmt_models.models.presets import (PAPER_DEVIATIONS, PAPER_ROWS, PAPER_ROWS_BY_NAME, TABLES, PaperRow, get_preset,
                                        presets_of)
from dtmt_models.models.registry import build_model, list_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTED = sorted({r.table for r in PAPER_ROWS if r.params is not None})


@pytest.fixture(scope="module")
def counts():
    """Our count of each row in its paper's layout (paper 002: Nematus' layer norm; catalog.layout_parameters)."""
    return {r.name: row_parameters(r) + layout_parameters(r) for r in PAPER_ROWS if r.params is not None}


def millions(x):
    return x / 1e6 if x >= 1e6 else x


# The largest difference, in millions, between our and the paper's difference of any two rows of a table: the
# bounds docs/usage.md's table states (checked below against its text). The papers round each count to 0.1 M, so a
# difference of two is known to ±0.1 M: no table needs more (measured 0.098 for 000-T3, 0.04-0.09 for 002's). 003-T1
# is held to 2 parameters by its own test, 004-T4 to 0.05 M a row absolutely (so 0.1 M a difference).
CLAIMED = {"000-T3": 0.1, "002-T1": 0.1, "002-T2": 0.1, "002-T3": 0.1, "002-T4": 0.1, "003-T1": 0.001,
           "004-T4": 0.1}


@pytest.mark.parametrize("table", COUNTED)
def test_table_differences_within_the_claimed_bound(table, counts):
    """Every pair of rows of a table: our difference equals the paper's within docs/usage.md's bound for the table
    (the papers round to 0.1 M), counted in the paper's layout; rows whose count is documented as not reproducible
    are left out, and there are few of them."""
    rows = [r for r in PAPER_ROWS if r.table == table and r.params is not None]
    usable = [r for r in rows if not r.unmatched]
    assert len(usable) >= len(rows) - 1 and len(usable) >= 3
    bad = []
    for a, b in itertools.combinations(usable, 2):
        ours = (counts[b.name] - counts[a.name]) / 1e6
        paper = millions(b.params) - millions(a.params)
        if abs(ours - paper) > CLAIMED[table]:
            bad.append(f"{a.name} -> {b.name}: ours {ours:+.3f} M, paper {paper:+.3f} M")
    assert not bad, "\n".join(bad)


def test_the_nematus_layout_counted_by_hand():
    """Paper 002's rows in Nematus' layout: a GRU with an input and layer norm has 15H biases, gains and offsets
    there (Wx and Uh each normalised, gates 2H and proposal H, a gain and an offset each: 12H; biases 3H), ours 6H;
    a transition GRU 9H there (Uh only: 6H; biases 3H), ours 5H; without layer norm 3H there, ours 6H with an
    input (torch's two biases) and 3H without. A deep-transition encoder of depth 2 at H = 16: 4 GRUs with an input
    (2 encoder directions, the decoder's two cGRU halves) and 2 T-GRUs. A biunidirectional encoder of depth 2: a
    bidirectional layer (its reverse direction's cell too) and a left-to-right layer 2H wide. Other papers' rows:
    nothing."""
    small = dict(embed_dim=8, hidden_size=16, tie_embeddings=True, dropout=0.0, encoder="deep-transition",
                 enc_transition_depth=2)
    assert layout_parameters(PaperRow("002-T2-x", "nematus", "x", small)) == 4 * (15 - 6) * 16 + 2 * (9 - 5) * 16
    assert layout_parameters(PaperRow("002-T2-x", "nematus", "x", dict(small, layer_norm=False))) == \
        4 * (3 - 6) * 16 + 2 * (3 - 3) * 16
    biuni = dict(small, encoder="biunidirectional", enc_depth=2)
    assert layout_parameters(PaperRow("002-T2-x", "nematus", "x", biuni)) == (2 + 2) * (15 - 6) * 16 + (15 - 6) * 32
    assert layout_parameters(PAPER_ROWS_BY_NAME["000-T3-dtmt4"]) == 0
    # the rows': alternating 8 is two stacks of 8 GRUs, stacked rGRU 8 a cGRU (2) and 7 levels above: 25; shallow 2 + 2
    assert layout_parameters(PAPER_ROWS_BY_NAME["002-T4-alternating8-rgru8"]) == 25 * 9 * 1024
    assert layout_parameters(PAPER_ROWS_BY_NAME["002-T4-shallow"]) == 4 * 9 * 1024


def test_the_docs_state_the_bounds_tested():
    """docs/usage.md's table of the papers' tables says, for each table it gives a bound for, the bound tested
    above (the README said "within 0.1 M" while the test allowed 0.15 M)."""
    with open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    for table in ("000-T3", "002-T1", "002-T2", "002-T3", "002-T4"):
        row = next(line for line in lines if line.startswith("|") and f"`{table}-`" in line)
        assert f"within {CLAIMED[table]:g} M" in row, (table, row)


def test_mce_table_1_differences_to_the_parameter(counts):
    """Paper 003 prints exact counts: the channel rows differ from RNN by what the paper says, to 2 parameters
    (the memory's two extra scalars); EMB is the documented exception, and its reason is checked."""
    rows = [r for r in PAPER_ROWS if r.table == "003-T1"]
    rnn = PAPER_ROWS_BY_NAME["003-T1-rnn"]
    for r in rows:
        if r.unmatched:
            continue
        ours, paper = counts[r.name] - counts[rnn.name], r.params - rnn.params
        assert abs(ours - paper) <= 2, (r.name, ours, paper)
    # the reason given for EMB: the paper's EMB is its NTM minus 1.5 · 1024² exactly
    assert PAPER_ROWS_BY_NAME["003-T1-ntm"].params - PAPER_ROWS_BY_NAME["003-T1-emb"].params == 1.5 * 1024 ** 2


def test_atr_table_4_absolute_counts(counts):
    """Paper 004 states the vocabularies (40K per side, tied target embedding): the absolute counts match too."""
    for name in ("004-T4-rnnsearch-gru", "004-T4-rnnsearch-atr", "004-T4-rnnsearch-atr-ca"):
        assert abs(counts[name] / 1e6 - PAPER_ROWS_BY_NAME[name].params) <= 0.051, name


def test_dtmt_paper_preset_is_dtmt4():
    """Paper 000 l.208 and Table 3: DTMT#4 has 4 T-GRUs in each of the encoder, query and decoder transitions,
    +65.2 M over SHALLOWRNMT (GRU) at 1024."""
    opts = get_preset("dtmt", "paper")["model"]
    assert (opts["encoder_depth"], opts["query_depth"], opts["decoder_depth"]) == (4, 4, 4)
    with torch.device("meta"):
        paper = build_model("dtmt", 30000, 30000, **opts)
        dtmt4 = build_model("dtmt", 30000, 30000, **PAPER_ROWS_BY_NAME["000-T3-dtmt4"].options)
    assert sum(p.numel() for p in paper.parameters()) == sum(p.numel() for p in dtmt4.parameters())


def test_rows_are_presets_of_their_system(tmp_path):
    assert len(PAPER_ROWS_BY_NAME) == len(PAPER_ROWS)            # names are unique
    for r in PAPER_ROWS:
        assert r.model in list_models() and r.table in TABLES and r.name.startswith(r.table)
        assert r.name in presets_of(r.model)
        p = get_preset(r.model, r.name)
        assert p["model"] == r.options and p["train"]["vocab_size"] >= 30000
    assert get_preset("dtmt", "000-T3-dtmt1")["train"]["lr"] == 1e-3        # the Zh⇒En settings of paper 000
    with pytest.raises(ValueError, match="nematus configuration"):
        get_preset("dtmt", "002-T4-bideep-4x2")
    text = describe()
    assert all(r.name in text for r in PAPER_ROWS) and all(m in text for m in list_models())
    # counted: a row in another layout than ours (paper 002's, Nematus') says our model's own count beside it, the
    # figure dtmt train logs (a review found "ours" taken for it)
    from dtmt_models.models.catalog import _row_model

    rows = [r for r in PAPER_ROWS if r.table == "002-T2"]
    for line, r in zip(describe(count=True, table="002-T2").splitlines()[1:], rows):
        built = sum(p.numel() for p in _row_model(r).parameters())
        assert line.startswith(f"  {r.name} ") and line.endswith(f"(built: {built / 1e6:.3f} M, as dtmt train "
                                                                 f"counts)"), line
    assert "built:" not in describe(count=True, table="000-T3")
    # dtmt train --preset ROW takes the row's system: an unknown option is refused naming that system
    from test_train import make_toy_corpus, run_train

    data = make_toy_corpus(tmp_path / "toy", n_train=20, n_dev=0, n_test=0)
    r = run_train(["--data", data, "--out", str(tmp_path / "run"), "--preset", "002-T4-bideep-4x2",
                   "--opt", "frobnicate=1"])
    assert r.returncode == 2 and "unknown option 'frobnicate' for nematus" in r.stderr
    assert not (tmp_path / "run").exists()


def shrink(model, options):
    """The structure of a configuration at tiny widths (a forward/backward of every preset in seconds)."""
    small = dict(options, embed_dim=8, hidden_size=8)
    if "heads" in small:
        small["heads"] = 2
    if model == "transformer":
        small.update(embed_dim=8, hidden_size=16)
    return small


def every_preset():
    out = {}
    for model in list_models():
        for preset in presets_of(model):
            opts = shrink(model, get_preset(model, preset)["model"])
            out.setdefault((model, repr(sorted(opts.items()))), (model, preset, opts))
    return sorted(out.values(), key=lambda x: (x[0], x[1]))


@pytest.mark.parametrize("model,preset,options", every_preset(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_parameter_of_every_preset_gets_a_gradient(model, preset, options):
    """A configuration builds only what it uses (contract §4): one forward/backward gives every parameter a
    non-zero gradient, for the small and paper presets and every paper row (at tiny widths)."""
    from test_models import V_SRC, V_TGT, toy_batch

    torch.manual_seed(0)
    m = build_model(model, V_SRC, V_TGT, **options)
    src, src_lengths, prev, tgt = toy_batch()
    loss, _, _ = m.loss(src, src_lengths, prev, tgt, smoothing=0.1)
    loss.backward()
    dead = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not dead, f"{model} {preset}: no gradient for {dead}"


def test_every_configuration_trains_under_two_process_ddp():
    """2 processes, gloo, find_unused_parameters off: every system and encoder/decoder/annotation choice of
    test_models.CONFIGS runs two updates and the processes stay equal (tests/ddp_every_config.py)."""
    from test_models import IDS

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29563",
           os.path.join(ROOT, "tests", "ddp_every_config.py")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert [line[3:] for line in r.stdout.splitlines() if line.startswith("ok ")] == IDS


def test_replicas_follow_the_flag_on_one_process(tmp_path, capsys):
    """--replicas sets the schedules' n (paper 000 eq. 17); without it n is the number of processes (the DDP
    test in test_train checks n = 2 on two)."""
    from test_train import TINY, make_toy_corpus, train_here

    data = make_toy_corpus(tmp_path / "toy", n_train=40, n_dev=0, n_test=0)
    r = train_here(["--data", data, "--out", str(tmp_path / "r"), "--max-steps", "1", "--replicas", "3", *TINY], capsys)
    assert r.returncode == 0, r.stderr
    assert "schedule rnmt (n = 3)" in r.stdout
    r = train_here(["--data", data, "--out", str(tmp_path / "s"), "--max-steps", "1", "--replicas", "0", *TINY], capsys)
    assert r.returncode == 2 and "--replicas 0" in r.stderr


def test_gnmt_decoder_layers_keep_their_own_output_as_state():
    """gnmt-atr: a residual sum feeds the next layer, it is never a layer's own recurrent state (GNMT §3.1):
    one step recomputed by hand from the decoder cells."""

    torch.manual_seed(0)
    m = build_model("gnmt-atr", 20, 20, embed_dim=8, hidden_size=8, encoder_layers=2, decoder_layers=4).eval()
    src, lengths = torch.randint(3, 20, (2, 5)), torch.tensor([5, 3])
    with torch.no_grad():
        state = m.encode(src, lengths)
        state["s"] = torch.randn_like(state["s"])          # distinct previous states per layer
        y = m.tgt_embed(torch.tensor([4, 7]))
        (top, c), new = m.transition(state, y)
        prev = state["s"]
        s0 = m.decoder[0](y, prev[:, 0])
        c_ref, _ = m.attention(s0, state["keys"], state["annotations"], state["src_mask"])
        x, states = s0, [s0]
        for l in range(1, 4):
            out = m.decoder[l](torch.cat([x, c_ref], -1), prev[:, l])
            states.append(out)
            x = out + x if l >= 2 else out
    torch.testing.assert_close(new["s"], torch.stack(states, 1))
    torch.testing.assert_close(top, x)
    assert not torch.allclose(new["s"][:, 3], top)             # the state is not the residual sum


def test_atr_paper_presets_follow_paper_004():
    """§4.2 (l.152): RNNSearch 620 / 1000 with 40K vocabularies, dropout 0.2 on the output layer; Adam (0.9, 0.999)
    at 5e-4 halved after each epoch, clipping 5.0, no label smoothing named; GNMT+ATR 512 / 512. What is not
    followed is listed in PAPER_DEVIATIONS and in docs/usage.md (none of paper 004's now). Batches of 80 sentences,
    under a token budget that lets the sentences bind (80 pairs of the longest kept); weights from U(±0.08), as
    paper 000's presets (l.194). Paper 001's deeplau: Adadelta (ε 1e-6, ρ 0.95, at Zeiler's rate 1), N(0, 0.04²)
    weights, clipping at 1.0, batches of 128."""
    rnnsearch = get_preset("rnnsearch-atr", "paper")
    assert rnnsearch["model"] == PAPER_ROWS_BY_NAME["004-T4-rnnsearch-atr"].options
    assert rnnsearch["model"]["embed_dim"] == 620 and rnnsearch["model"]["hidden_size"] == 1000
    assert rnnsearch["model"]["dropout"] == 0.2
    for system in ("rnnsearch-atr", "gnmt-atr"):
        train = get_preset(system, "paper")["train"]
        assert (train["vocab_size"], train["lr"], train["schedule"], train["clip"], train["smoothing"],
                train["adam_beta2"]) == (40000, 5e-4, "epoch-halving", 5.0, 0.0, 0.999), system
        assert train["max_sentences"] == 80 and train["max_tokens"] >= 80 * (train["max_len"] + 1), system
    for system, preset in (("rnnsearch-atr", "paper"), ("gnmt-atr", "paper"), ("rnnsearch-atr", "004-T2-rnnsearch-atr"),
                           ("dtmt", "paper"), ("shallow-rnmt", "paper"), ("dtmt", "000-T3-dtmt4")):
        assert get_preset(system, preset)["train"]["init_uniform"] == 0.08, (system, preset)
    deeplau = get_preset("deeplau", "paper")["train"]             # paper 001: l.157 (N(0, 0.04²)), l.160-177
    assert (deeplau["max_sentences"], deeplau["optimizer"], deeplau["adadelta_rho"], deeplau["adadelta_eps"],
            deeplau["lr"], deeplau["schedule"], deeplau["init_normal"], deeplau["clip"]) == (
        128, "adadelta", 0.95, 1e-6, 1.0, "constant", 0.04, 1.0)
    assert "init_uniform" not in deeplau
    gnmt = get_preset("gnmt-atr", "paper")["model"]
    assert gnmt == PAPER_ROWS_BY_NAME["004-T2-gnmt-atr"].options and gnmt["hidden_size"] == 512
    with open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8") as f:
        usage = f.read()
    for paper, items in PAPER_DEVIATIONS.items():
        for item in items:
            assert item in usage, (paper, item)


def _perturbed(m):
    """m with every parameter moved off its initial value (no term hides behind an initial 0 or 1), in place."""
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


def _cell_step(module, x, h, direction=0):
    """One step of a recurrent module's direction from its parameters, by the executable spec's equations."""
    import dtmt_kernels as dk

    w = module.direction_weights(direction)
    return dk.reference.transition_step(torch.nn.functional.linear(x, w.w_ih, w.b_ih)[None], h[None], w)[0]


def _layer_norm(norm, x):
    """nn.LayerNorm's affine normalisation of a vector, written out."""
    return (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + norm.eps) * norm.weight + norm.bias


def _run_direction(module, xs, reverse=False, direction=0):
    """A recurrent module's direction over the vectors `xs` from a zero state, left to right (right to left with
    `reverse`), one _cell_step at a time: its outputs in the order of xs."""
    H = module.direction_weights(direction).w_hh.shape[1]
    out, h = [None] * len(xs), torch.zeros(H, dtype=torch.float64)
    for j in (reversed(range(len(xs))) if reverse else range(len(xs))):
        h = out[j] = _cell_step(module, xs[j], h, direction)
    return out


def _alternating_annotations(m, x, levels):
    """nematus' alternating (and BiDeep) encoder by hand over the embeddings `x`: two chains of `levels` levels,
    chain 0 starting left to right and chain 1 right to left, each level reading the one below in the opposite
    direction, with residual sums from the second level on; C_i = [top of chain 0; top of chain 1], [S, 2H]."""
    tops = []
    for chain in range(2):
        w = x
        for level in range(levels):
            out = _run_direction(m.encoder[chain * levels + level], w, reverse=(chain + level) % 2 == 1)
            w = [o + v for o, v in zip(out, w)] if level > 0 else out
        tops.append(w)
    return torch.stack([torch.cat([f, r]) for f, r in zip(*tops)])


def _nematus_log_probs(m, y, r, c):
    """nematus' readout by hand: tanh(LN(W_y y) + LN(W_s r + b) + LN(W_c c)) into the log-softmax."""
    ro, ln = m.readout, _layer_norm
    ny, ns, nc = ro.norms
    o = torch.tanh(ln(ny, ro.from_y.weight @ y) + ln(ns, ro.from_s.weight @ r + ro.from_s.bias)
                   + ln(nc, ro.from_c.weight @ c))
    return torch.log_softmax(ro.output.proj.weight @ o + ro.output.proj.bias, 0)


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("system", ["dtmt", "dtmt-depths", "rnnsearch-atr"])
def test_recomputed_from_the_paper_equations(system, backend):
    """dtmt's teacher-forced log-probabilities against a hand computation of paper 000 from the parameters, one
    sentence and one step at a time (only the cells' equations from the executable spec,
    dk.reference.transition_step): embeddings plus sin/cos positions / sqrt(d); a bidirectional deep transition
    encoder, each direction from its own end of the sentence; s_0 = tanh(W mean_j h_j + b); per step the query
    transition on y_{t-1} from s_{t-1}, multi-head additive attention on its top state (e = v_h . tanh(W_q s + W_k
    h_j + b_k), head h weighing its slice of the annotations, then one output projection), the decoder transition
    on c_t from the query's top state, and the readout tanh(LN(W_y y) + LN(W_s s + b) + LN(W_c c)) into the
    softmax. Catches any mis-wired module (which state the decoder transition starts from, what the attention
    queries, which positions the target embedding takes), which the self-consistency tests cannot.
    rnnsearch-atr the same way after paper 004 §4.1: ATR units, no positions, single-head additive attention
    (the context the plain weighted sum), readout tanh(W_y y + W_s s + b + W_c c), output tied to the target
    embedding. dtmt-depths: the encoder, query and decoder transitions each of its own depth (1, 3, 2 T-GRUs: paper
    000's encoder_depth, query_depth, decoder_depth), each module holding the depth it was given."""
    import math

    import dtmt_kernels as dk
    if backend not in dk.available_backends():
        pytest.skip(f"{backend} not built")
    E, H, heads, V = 6, 8, 2, 13
    torch.manual_seed(2)
    dtmt = system.startswith("dtmt")
    depths = dict(encoder_depth=1, query_depth=3, decoder_depth=2) if system == "dtmt-depths" else dict(depth=2)
    options = dict(heads=heads, **depths) if dtmt else {}
    m = build_model(system[:4] if dtmt else system, V, V, embed_dim=E, hidden_size=H, backend=backend,
                    **options).double().eval()
    if dtmt:   # (the hand computation runs each module's own T-GRUs: that they are the ones asked for)
        want = (1, 3, 2) if system == "dtmt-depths" else (2, 2, 2)
        assert tuple(mod.direction_weights(0).depth for mod in (m.encoder, m.query_cell, m.decoder_cell)) == want
    _perturbed(m)
    src = torch.tensor([[5, 7, 3, 9, 4], [8, 6, 11, 0, 0]])
    src_len = torch.tensor([5, 3])
    prev = torch.tensor([[1, 4, 9, 6], [1, 12, 5, 7]])
    with torch.no_grad():
        got = m(src, src_len, prev)

    def pe(t, d):
        row = torch.zeros(d, dtype=torch.float64)
        if not dtmt:
            return row
        for i in range(0, d, 2):
            angle = t / 10000 ** (i / d)
            row[i] = math.sin(angle)
            if i + 1 < d:
                row[i + 1] = math.cos(angle)
        return row / math.sqrt(d)

    cell = _cell_step

    def ln(norm, x):
        return _layer_norm(norm, x) if dtmt else x

    att, ro = m.attention, m.readout
    with torch.no_grad():
        for b in range(2):
            S = int(src_len[b])
            xs = [m.src_embed.embed.weight[src[b, j]] + pe(j, E) for j in range(S)]
            fwd, h = [], torch.zeros(H, dtype=torch.float64)
            for j in range(S):
                h = cell(m.encoder, xs[j], h, 0)
                fwd.append(h)
            bwd, h = [None] * S, torch.zeros(H, dtype=torch.float64)
            for j in reversed(range(S)):
                h = cell(m.encoder, xs[j], h, 1)
                bwd[j] = h
            ann = torch.stack([torch.cat([f, r]) for f, r in zip(fwd, bwd)])           # [S, 2H]
            s = torch.tanh(m.init_state.weight @ ann.mean(0) + m.init_state.bias)
            keys = ann @ att.key.weight.T + att.key.bias                                # [S, A]
            n_heads = heads if dtmt else 1
            A, C = keys.shape[1] // n_heads, ann.shape[1] // n_heads
            v = att.v if dtmt else att.v.weight                                         # [heads, A]
            for t in range(prev.shape[1]):
                y = m.tgt_embed.embed.weight[prev[b, t]] + pe(t, E)
                s_q = cell(m.query_cell, y, s)
                q = att.query.weight @ s_q
                ctx = []
                for k in range(n_heads):
                    e = torch.stack([v[k] @ torch.tanh(q[k * A:(k + 1) * A] + keys[j, k * A:(k + 1) * A])
                                     for j in range(S)])
                    alpha = torch.softmax(e, 0)
                    ctx.append(alpha @ ann[:, k * C:(k + 1) * C])                      # head k: its 2H/heads slice
                c = att.out.weight @ torch.cat(ctx) + att.out.bias if dtmt else ctx[0]
                s = cell(m.decoder_cell, c, s_q)
                if not dtmt:
                    assert ro.output.proj.weight is m.tgt_embed.embed.weight                 # tied
                ny, ns, nc = ro.norms
                o = torch.tanh(ln(ny, ro.from_y.weight @ y) + ln(ns, ro.from_s.weight @ s + ro.from_s.bias)
                               + ln(nc, ro.from_c.weight @ c))
                logits = ro.output.proj.weight @ o + ro.output.proj.bias
                torch.testing.assert_close(got[b, t], torch.log_softmax(logits, 0), rtol=1e-10, atol=1e-10,
                                           msg=f"sentence {b}, step {t}")


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_nematus_deep_recomputed_from_paper_002(backend):
    """nematus with the alternating encoder and the rGRU stacked decoder (paper 002 §2.3), teacher-forced
    log-probabilities against a hand computation from the parameters, one sentence and step at a time (the GRU
    equations from dk.reference): two encoder chains of three GRU levels, chain 0 starting left to right and
    chain 1 right to left, each level reading the one below in the opposite direction, with residual sums from
    the second level on (the top level's too, as the authors' code; the paper writes 1 < j < D_s), and
    C_i = [top of chain 0; top of chain 1]; s_0 = tanh(W mean_i C_i) for every decoder
    level; the conditional GRU at the base (s' = GRU(y, s), c = attention with layer norm on the query's and the
    keys' projections, s = GRU(c, s')); each higher level GRU([r_{k-1}; c], its own state) summed with the level
    below; the readout tanh(LN(W_y y) + LN(W_s r + b) + LN(W_c c)) into the softmax tied to the target embedding.
    Fails under each of four mis-wirings tried (chains' first directions swapped, no residual at level 2, levels
    reading the level below's state instead of the residual sum, the base's second GRU from s_{t-1})."""
    import dtmt_kernels as dk
    if backend not in dk.available_backends():
        pytest.skip(f"{backend} not built")
    E, H, V = 6, 5, 11
    torch.manual_seed(3)
    m = build_model("nematus", V, V, embed_dim=E, hidden_size=H, encoder="alternating", decoder="rgru", enc_depth=3,
                    dec_depth=3, backend=backend).double().eval()
    _perturbed(m)
    src, src_len = torch.tensor([[4, 9, 3, 7], [5, 8, 0, 0]]), torch.tensor([4, 2])
    prev = torch.tensor([[1, 6, 2, 9, 4], [1, 3, 10, 5, 7]])
    with torch.no_grad():
        got = m(src, src_len, prev)

    step, ln = _cell_step, _layer_norm
    att = m.attention
    assert m.readout.output.proj.weight is m.tgt_embed.embed.weight                     # tied
    with torch.no_grad():
        for b in range(2):
            S = int(src_len[b])
            C = _alternating_annotations(m, [m.src_embed.embed.weight[src[b, i]] for i in range(S)], 3)
            s0 = torch.tanh(m.init_state.weight @ C.mean(0) + m.init_state.bias)
            keys = [ln(att.ln_k, att.key.weight @ C[i] + att.key.bias) for i in range(S)]
            states = [s0, s0, s0]
            for t in range(prev.shape[1]):
                y = m.tgt_embed.embed.weight[prev[b, t]]
                s1 = step(m.query_cell, y, states[0])
                q = ln(att.ln_q, att.query.weight @ s1)
                alpha = torch.softmax(torch.stack([att.v.weight[0] @ torch.tanh(q + k) for k in keys]), 0)
                c = alpha @ C
                new = [step(m.decoder_cell, c, s1)]
                r = new[0]
                for k in (1, 2):
                    out = step(m.levels[k - 1].cell, torch.cat([r, c]), states[k])
                    new.append(out)
                    r = out + r
                states = new
                torch.testing.assert_close(got[b, t], _nematus_log_probs(m, y, r, c), rtol=1e-10, atol=1e-10,
                                           msg=f"sentence {b}, step {t}")


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_deeplau_recomputed_from_paper_001(backend):
    """deeplau's teacher-forced log-probabilities against a hand computation of paper 001 from the parameters, one
    sentence and step at a time (the LAU equations from dk.reference): three encoder layers of alternating
    direction, d = (-1)^l (eq. 9: the first left to right, each next one reading the layer below's outputs the
    other way), the annotations the top layer's; attention queried by the first decoder layer's previous state and
    y_{t-1} (eq. 10-11: e = v^T tanh(W_a s^1_{t-1} + W_y y_{t-1} + U_a h_j + b)); decoder layer 1 reading
    [c_t; y_{t-1}], each next layer the output of the one below, every layer from its own previous state, each
    starting from its slice of tanh(W mean_j h_j + b); softmax(W_o s^top + b) (eq. 12). Fails under each of three
    mis-wirings tried (the encoder's directions swapped, attention queried by the top layer, every decoder layer
    from the first layer's state)."""
    import dtmt_kernels as dk
    if backend not in dk.available_backends():
        pytest.skip(f"{backend} not built")
    E, H, V, L = 6, 5, 11, 3
    torch.manual_seed(4)
    m = build_model("deeplau", V, V, embed_dim=E, hidden_size=H, encoder_layers=L, decoder_layers=L,
                    backend=backend).double().eval()
    _perturbed(m)
    src, src_len = torch.tensor([[4, 9, 3, 7, 2], [5, 8, 6, 0, 0]]), torch.tensor([5, 3])
    prev = torch.tensor([[1, 6, 2, 9], [1, 3, 10, 5]])
    with torch.no_grad():
        got = m(src, src_len, prev)

    step = _cell_step
    att = m.attention
    with torch.no_grad():
        for b in range(2):
            S = int(src_len[b])
            h = [m.src_embed.embed.weight[src[b, i]] for i in range(S)]
            for l in range(L):
                out, state = [None] * S, torch.zeros(H, dtype=torch.float64)
                for i in (reversed(range(S)) if l % 2 else range(S)):     # d = (-1)^l: layer 2 right to left
                    state = out[i] = step(m.encoder[l], h[i], state)
                h = out
            ann = torch.stack(h)                                                          # [S, H]
            s = list(torch.tanh(m.init_state.weight @ ann.mean(0) + m.init_state.bias).view(L, H))
            keys = ann @ att.key.weight.T + att.key.bias
            for t in range(prev.shape[1]):
                y = m.tgt_embed.embed.weight[prev[b, t]]
                q = att.query.weight @ torch.cat([s[0], y])
                alpha = torch.softmax(torch.stack([att.v.weight[0] @ torch.tanh(q + k) for k in keys]), 0)
                x = torch.cat([alpha @ ann, y])
                for l in range(L):
                    x = s[l] = step(m.decoder[l], x, s[l])
                logits = m.readout.proj.weight @ x + m.readout.proj.bias
                torch.testing.assert_close(got[b, t], torch.log_softmax(logits, 0), rtol=1e-10, atol=1e-10,
                                           msg=f"sentence {b}, step {t}")


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_mce_annotations_recomputed_from_paper_003(backend):
    """mce's annotations (ntm-rnn-emb, the backward direction reading the forward states) against a hand
    computation of paper 003 eq. 13-25 as the module docstring reads them, one sentence and step at a time from
    the parameters: per direction a memory of the sentence's projected embeddings; each step the addressing
    weights w = softmax_i v^T tanh(U s + W M[i] + b), the read gate R = sigmoid(W_r s + b_r) on every cell, the
    read content c = sum_i w_i R*M[i], s = GRU([x_t; c], s), and the write M[i] = R*M[i] + w_i sigmoid(W_u s +
    b_u); channels rnn = [fwd s; bwd s], ntm = [fwd M_final; bwd M_final], emb = e; annotation gate(E, gate(M,
    h)) with gate(a, b) = g (A a) + (1 - g) (B b), g = sigmoid(W a + U b + bias). The decoder is the attentional
    RNMT's, checked by test_recomputed_from_the_paper_equations. Fails if the backward direction reads the
    embeddings, if the read gate is left out of the memory that is written, or if the gates' two inputs swap."""
    import dtmt_kernels as dk
    if backend not in dk.available_backends():
        pytest.skip(f"{backend} not built")
    E, H, V = 4, 5, 11
    torch.manual_seed(5)
    m = build_model("mce", V, V, embed_dim=E, hidden_size=H, backend=backend).double().eval()
    _perturbed(m)
    with torch.no_grad():
        src, src_len = torch.tensor([[4, 9, 3, 7, 2], [5, 8, 6, 0, 0]]), torch.tensor([5, 3])
        got = m.encode_source(src, src_len)

    gru = _cell_step

    def lin(layer, x):
        return layer.weight @ x + (layer.bias if layer.bias is not None else 0)

    def direction(d, xs, memory, reverse):
        s, M, states = torch.zeros(H, dtype=torch.float64), [r.clone() for r in memory], [None] * len(xs)
        for t in (reversed(range(len(xs))) if reverse else range(len(xs))):
            e = torch.stack([lin(d.address_v, torch.tanh(lin(d.address_state, s) + lin(d.address_memory, r)))[0]
                             for r in M])
            w = torch.softmax(e, 0)
            R = torch.sigmoid(lin(d.read_gate, s))
            read = [R * r for r in M]
            c = sum(w[i] * read[i] for i in range(len(M)))
            s = states[t] = gru(d.cell, torch.cat([xs[t], c]), s)
            U = torch.sigmoid(lin(d.write_gate, s))
            M = [read[i] + w[i] * U for i in range(len(M))]
        return states, M

    def gate(g, a, b):
        z = torch.sigmoid(lin(g.w, a) + lin(g.u, b))
        return z * lin(g.proj_a, a) + (1 - z) * lin(g.proj_b, b)

    with torch.no_grad():
        for b in range(2):
            S = int(src_len[b])
            emb = [m.src_embed.embed.weight[src[b, i]] for i in range(S)]
            memory = [m.memory_init.weight @ e for e in emb]
            h_f, m_f = direction(m.encoder_fwd, emb, memory, reverse=False)
            h_b, m_b = direction(m.encoder_bwd, h_f, memory, reverse=True)
            for j in range(S):
                rnn = torch.cat([h_f[j], h_b[j]])
                ntm = torch.cat([m_f[j], m_b[j]])
                expected = gate(m.gate_emb, emb[j], gate(m.gate_ntm_rnn, ntm, rnn))
                torch.testing.assert_close(got[b, j], expected, rtol=1e-10, atol=1e-10, msg=f"sentence {b}, {j}")


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("encoder", ["ca", "gnmt"])
def test_atr_encoders_recomputed_from_paper_004(encoder, backend):
    """The annotations of paper 004's two other encoders against a hand computation from the parameters, one
    sentence and step at a time (the ATR equations from dk.reference). ca (the context-aware encoder, as the
    authors' code lays it out): a forward ATR →h_j over x, then right to left s̃_j = ATR_lo(x_j, ←h_{j+1}),
    ←h_j = ATR_hi(→h_j, s̃_j), the annotations ←h_j (H wide). gnmt (GNMT §3, four layers): a bidirectional bottom
    layer [→h; ←h], then left-to-right layers, the second reading the bottom's 2H, each from the third on reading
    the sum of the two below's outputs (x^l = s^l + x^{l-1}); the annotations the top sum."""
    import dtmt_kernels as dk
    if backend not in dk.available_backends():
        pytest.skip(f"{backend} not built")
    E, H, V = 6, 5, 11
    torch.manual_seed(5)
    if encoder == "ca":
        m = build_model("rnnsearch-atr", V, V, embed_dim=E, hidden_size=H, encoder="ca", backend=backend)
    else:
        m = build_model("gnmt-atr", V, V, embed_dim=E, hidden_size=H, encoder_layers=4, decoder_layers=2,
                        backend=backend)
    m = _perturbed(m.double().eval())
    src, src_len = torch.tensor([[4, 9, 3, 7, 2], [5, 8, 6, 0, 0]]), torch.tensor([5, 3])
    with torch.no_grad():
        got = m.encode(src, src_len)["annotations"]
    step, run = _cell_step, _run_direction
    with torch.no_grad():
        for b in range(2):
            S = int(src_len[b])
            x = [m.src_embed.embed.weight[src[b, j]] for j in range(S)]
            if encoder == "ca":
                ca = m.encoder
                fwd = run(ca.forward_layer, x)
                ann, h = [None] * S, torch.zeros(H, dtype=torch.float64)
                for j in reversed(range(S)):
                    h = ann[j] = step(ca.higher, fwd[j], step(ca.lower, x[j], h))
            else:
                fwd, bwd = run(m.encoder[0], x), run(m.encoder[0], x, reverse=True, direction=1)
                ann = run(m.encoder[1], [torch.cat([f, r]) for f, r in zip(fwd, bwd)])
                for layer in m.encoder[2:]:
                    ann = [o + a for o, a in zip(run(layer, ann), ann)]
            torch.testing.assert_close(got[b, :S], torch.stack(ann), rtol=1e-10, atol=1e-10, msg=f"sentence {b}")
            assert torch.count_nonzero(got[b, S:]) == 0


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("high", ["gru", "rgru", "cgru", "crgru"])
def test_nematus_bideep_recomputed_from_paper_002(high, backend):
    """nematus BiDeep (paper 002 §2.4): the encoder the alternating chains of test_nematus_deep_recomputed_..., each
    level a deep-transition block of 2 GRU steps; the decoder 3 levels, the base cGRU of transition depth 3
    (GRU(y, s), attention, then a block of 2 GRU steps on c_1), each higher level a cell of §2.3 made of
    deep-transition blocks of depth 3: gru: DT(r_{k-1}, own state); rgru: DT([r_{k-1}; c_1], own state); cgru: a
    conditional GRU with an attention of its own, s1_k = GRU(r_{k-1}, own state), c_k = ATT_k(s1_k) (its own
    query, keys, v and layer norms), out_k = DT(c_k, s1_k) of 2 steps; crgru: the same with c_1 for c_k;
    r_k = out_k + r_{k-1}. Teacher-forced log-probabilities against the hand computation, to 1e-10."""
    import dtmt_kernels as dk
    if backend not in dk.available_backends():
        pytest.skip(f"{backend} not built")
    E, H, V = 6, 5, 11
    torch.manual_seed(6)
    m = build_model("nematus", V, V, embed_dim=E, hidden_size=H, encoder="bideep", enc_depth=2, enc_transition_depth=2,
                    decoder="bideep", dec_high_cell=high, dec_depth=3, dec_base_transition_depth=3,
                    dec_high_transition_depth=3, backend=backend).double().eval()
    _perturbed(m)
    blocks = [m.encoder[0], m.decoder_cell] + [lv.cell if high in ("gru", "rgru") else lv.second for lv in m.levels]
    assert [b.direction_weights(0).depth for b in blocks] == [1, 1] + [2 if high in ("gru", "rgru") else 1] * 2
    src, src_len = torch.tensor([[4, 9, 3, 7], [5, 8, 6, 0]]), torch.tensor([4, 3])
    prev = torch.tensor([[1, 6, 2, 9], [1, 3, 10, 5]])
    with torch.no_grad():
        got = m(src, src_len, prev)

    step, ln = _cell_step, _layer_norm

    def attend(att, keys, C, s):
        q = ln(att.ln_q, att.query.weight @ s)
        return torch.softmax(torch.stack([att.v.weight[0] @ torch.tanh(q + k) for k in keys]), 0) @ C

    with torch.no_grad():
        for b in range(2):
            S = int(src_len[b])
            C = _alternating_annotations(m, [m.src_embed.embed.weight[src[b, i]] for i in range(S)], 2)
            s0 = torch.tanh(m.init_state.weight @ C.mean(0) + m.init_state.bias)

            def keys_of(att):
                return [ln(att.ln_k, att.key.weight @ C[i] + att.key.bias) for i in range(S)]

            states = [s0, s0, s0]
            for t in range(prev.shape[1]):
                y = m.tgt_embed.embed.weight[prev[b, t]]
                s1 = step(m.query_cell, y, states[0])
                c1 = attend(m.attention, keys_of(m.attention), C, s1)
                new = [step(m.decoder_cell, c1, s1)]
                r = new[0]
                for k in (1, 2):
                    level = m.levels[k - 1]
                    if high in ("gru", "rgru"):
                        out = step(level.cell, r if high == "gru" else torch.cat([r, c1]), states[k])
                    else:
                        s1k = step(level.first, r, states[k])
                        ck = attend(level.attention, keys_of(level.attention), C, s1k) if high == "cgru" else c1
                        out = step(level.second, ck, s1k)
                    new.append(out)
                    r = out + r
                states = new
                torch.testing.assert_close(got[b, t], _nematus_log_probs(m, y, r, c1), rtol=1e-10, atol=1e-10,
                                           msg=f"sentence {b}, step {t}")


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_mce_decoder_recomputed_from_paper_003(backend):
    """mce's decoder (paper 003 eq. 1-6, RNNsearch's) against a hand computation from the parameters, from the
    annotations the encoder gives (recomputed by test_mce_annotations_recomputed_from_paper_003): s_0 =
    tanh(W mean_j C_j + b); per step s'_j = GRU(y_{j-1}, s_{j-1}), e = v . tanh(W_q s'_j + W_k C_i + b_k) in an
    attention space H wide (not the annotations' 2H), c_j = sum alpha C, s_j = GRU(c_j, s'_j), t_j = tanh(W_y y +
    W_s s_j + b + W_c c_j), softmax(W_o t_j + b_o), the output not tied (the paper's 30K target vocabulary has its
    own). Teacher-forced log-probabilities to 1e-10."""
    import dtmt_kernels as dk
    if backend not in dk.available_backends():
        pytest.skip(f"{backend} not built")
    E, H, V = 6, 5, 11
    torch.manual_seed(7)
    m = _perturbed(build_model("mce", V, V, embed_dim=E, hidden_size=H, backend=backend).double().eval())
    src, src_len = torch.tensor([[4, 9, 3, 7], [5, 8, 6, 0]]), torch.tensor([4, 3])
    prev = torch.tensor([[1, 6, 2, 9, 3], [1, 3, 10, 5, 4]])
    with torch.no_grad():
        got = m(src, src_len, prev)
        annotations = m.encode(src, src_len)["annotations"]
    att, ro, step = m.attention, m.readout, _cell_step
    assert att.key.weight.shape == (H, 2 * H) and ro.output.proj.weight is not m.tgt_embed.embed.weight
    with torch.no_grad():
        for b in range(2):
            C = annotations[b, :int(src_len[b])]
            s = torch.tanh(m.init_state.weight @ C.mean(0) + m.init_state.bias)
            keys = C @ att.key.weight.T + att.key.bias
            for t in range(prev.shape[1]):
                y = m.tgt_embed.embed.weight[prev[b, t]]
                s_q = step(m.query_cell, y, s)
                alpha = torch.softmax(torch.tanh(att.query.weight @ s_q + keys) @ att.v.weight[0], 0)
                c = alpha @ C
                s = step(m.decoder_cell, c, s_q)
                o = torch.tanh(ro.from_y.weight @ y + ro.from_s.weight @ s + ro.from_s.bias + ro.from_c.weight @ c)
                logits = ro.output.proj.weight @ o + ro.output.proj.bias
                torch.testing.assert_close(got[b, t], torch.log_softmax(logits, 0), rtol=1e-10, atol=1e-10,
                                           msg=f"sentence {b}, step {t}")


def test_every_row_trains_at_the_vocabulary_its_table_is_counted_at():
    """A row's preset trains with the vocabulary size per side at which `dtmt models --count` counts it: paper 002's
    rows had trained with the nematus paper preset's 90,000 (126 M for the baseline) while counted at 60,000
    (95.3 M, against the paper's 98.0; a review found it)."""
    assert {r.name: get_preset(r.model, r.name)["train"]["vocab_size"] for r in PAPER_ROWS} == \
        {r.name: TABLES[r.table].vocab for r in PAPER_ROWS}
