"""The public layers: torch.nn.GRU-like behaviour, from_torch, backend switching, input validation."""
import re

import pytest
import torch

import dtmt_kernels as dk

from conftest import make_layer

BACKENDS = [b for b in ("reference", "cpp") if b in dk.available_backends()]


def test_available_backends_tell_the_truth():
    names = dk.available_backends()
    assert "reference" in names and "cpp" in names
    assert "triton" not in names or torch.cuda.is_available()
    assert dk.resolve_backend("auto", torch.device("cpu")).name == "cpp"


def test_what_a_review_found_at_the_public_surface_is_one_line():
    """resolve_backend takes a device's name (a string had been an AttributeError) and refuses a bad one or None in
    one line; a layer on the meta device says no backend runs meta tensors (it had advised the reference backend,
    which refused them too); a PackedSequence whose two index orders are not each other's inverse is refused as a
    packing (a traceback deep inside); checked_lengths refuses lengths that are no 1-D integers (1.5 had passed)."""
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

    assert dk.resolve_backend("auto", "cpu").name == "cpp"
    for device, message in ((None, r"device None is not a device torch knows \(not a device name\)$"),
                            ("nonsense", "device 'nonsense' is not a device torch knows"),
                            ("meta", "^no backend runs meta tensors")):
        with pytest.raises(ValueError, match=message):
            dk.resolve_backend("auto", device)
    layer = dk.nn.DeepTransitionGRU(4, 3)
    with pytest.raises(ValueError, match="^no backend runs meta tensors"):
        dk.nn.DeepTransitionGRU(4, 3).to("meta")(torch.randn(5, 2, 4, device="meta"))
    packed = pack_padded_sequence(torch.randn(5, 3, 4), torch.tensor([2, 5, 3]), enforce_sorted=False)
    forged = PackedSequence(packed.data, packed.batch_sizes, packed.sorted_indices, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="unsorted_indices must be the inverse of sorted_indices$"):
        layer(forged)
    assert layer(packed)[0].data.shape == (10, 3)
    for lengths in (torch.tensor([1.5, 2.0]), torch.tensor([[1, 2]]), torch.tensor(2)):
        with pytest.raises(ValueError, match="^owner: lengths must be a 1-D tensor of integers"):
            torch.ops.dtmt.checked_lengths(lengths, torch.empty(5), "owner")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_from_torch_reproduces_torch_gru(backend, bidirectional, batch_first):
    torch.manual_seed(0)
    gru = torch.nn.GRU(6, 10, bidirectional=bidirectional, batch_first=batch_first)
    layer = dk.nn.DeepTransitionGRU.from_torch(gru, backend=backend)
    assert (layer.cell, layer.depth, layer.layer_norm) == ("gru", 0, False)
    D = 2 if bidirectional else 1
    x = torch.randn((4, 7, 6) if batch_first else (7, 4, 6), requires_grad=True)
    h0 = torch.randn(D, 4, 10)
    out, h_n = layer(x, h0)
    out_t, h_t = gru(x, h0)
    torch.testing.assert_close(out, out_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h_n, h_t, atol=1e-5, rtol=1e-5)
    # the initial state by torch.nn.GRU's keyword too (code written for it says hx=)
    out_k, h_k = layer(x, hx=h0)
    assert torch.equal(out_k, out) and torch.equal(h_k, h_n)
    with pytest.raises(ValueError, match="DeepTransitionGRU: give the initial state once, as h0 or as hx"):
        layer(x, h0, hx=h0)
    # the gradients of the input and of every weight and bias agree too (ours of the update gate's rows negated,
    # as from_torch negates the rows themselves)
    g_out, g_h = torch.randn_like(out), torch.randn_like(h_n)
    grads = torch.autograd.grad((out * g_out).sum() + (h_n * g_h).sum(), [x, *layer.parameters()])
    grads_t = torch.autograd.grad((out_t * g_out).sum() + (h_t * g_h).sum(), [x, *gru.parameters()])
    torch.testing.assert_close(grads[0], grads_t[0], atol=1e-5, rtol=1e-5)
    assert len(grads) == len(grads_t)
    for (name, _), g, g_t in zip(layer.named_parameters(), grads[1:], grads_t[1:]):
        g_t = g_t.clone()
        g_t[10:20] = -g_t[10:20]
        torch.testing.assert_close(g, g_t, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_an_empty_batch_is_answered_as_torch_gru_answers_it(backend, bidirectional, batch_first):
    """A batch of no sequences (B = 0: the last shard of an uneven split, a filter that kept nothing) gives what
    torch.nn.GRU and torch.nn.GRUCell give: empty outputs of the same shapes and dtype, in the autograd graph, whose
    backward leaves zero gradients on the input, h0 and every parameter (torch's too); also with lengths=[], in
    training with candidate dropout, and for a cell inside an unrolled block. No step is refused as torch does
    (T = 0)."""
    torch.manual_seed(2)
    gru = torch.nn.GRU(6, 10, bidirectional=bidirectional, batch_first=batch_first)
    layer = dk.nn.DeepTransitionGRU.from_torch(gru, backend=backend)
    D = 2 if bidirectional else 1
    for h0 in (None, torch.randn(D, 0, 10, requires_grad=True)):
        x = torch.randn((0, 7, 6) if batch_first else (7, 0, 6), requires_grad=True)
        got, want = layer(x, h0), gru(x, h0)
        for a, b in zip(got, want):
            assert (a.shape, a.dtype, a.requires_grad) == (b.shape, b.dtype, True)
        (got[0].sum() + got[1].sum()).backward()
        (want[0].sum() + want[1].sum()).backward()
        assert x.grad.shape == x.shape and (h0 is None or h0.grad.shape == h0.shape)
        for (name, p), p_t in zip(layer.named_parameters(), gru.parameters()):
            assert torch.equal(p.grad, torch.zeros_like(p)) and torch.equal(p_t.grad, torch.zeros_like(p_t)), name
        layer.zero_grad(), gru.zero_grad()
    assert layer(torch.randn((0, 7, 6) if batch_first else (7, 0, 6)), lengths=[])[0].shape == want[0].shape
    with pytest.raises(ValueError, match="at least one step"):   # (torch: "Expected sequence length to be larger")
        layer(torch.randn((3, 0, 6) if batch_first else (0, 3, 6)))
    deep = dk.nn.DeepTransitionGRU(6, 10, depth=2, layer_norm=True, candidate_dropout=0.3, backend=backend).train()
    assert deep(torch.randn(7, 0, 6))[0].shape == (7, 0, 10)
    cell = dk.nn.DeepTransitionGRUCell(6, 10, depth=1, backend=backend)
    ref = torch.nn.GRUCell(6, 10)
    x = torch.randn(0, 6, requires_grad=True)
    with dk.nn.unrolled(cell):
        h = cell(x)
        assert (h.shape, h.dtype) == (ref(x).shape, ref(x).dtype) == ((0, 10), torch.float32)
        h.sum().backward()
    assert x.grad.shape == (0, 6) and all(torch.equal(p.grad, torch.zeros_like(p)) for p in cell.parameters())


def test_a_backend_that_cannot_run_here_is_refused_at_any_batch_size():
    """An unavailable backend is an error that says why, at B = 0 too (an empty batch returned empty tensors where
    B = 1 refused), for the layer and the cell."""
    missing = next((b for b in ("cuda", "triton") if b not in dk.available_backends()), None)
    if missing is None:
        pytest.skip("every backend is available here")
    for module, x in ((dk.nn.DeepTransitionGRU(5, 4, backend=missing), torch.randn(3, 0, 5)),
                      (dk.nn.DeepTransitionGRUCell(5, 4, backend=missing), torch.randn(0, 5))):
        for batch in (x, torch.randn(*x.shape[:-2], 1, 5) if x.dim() == 3 else torch.randn(1, 5)):
            with pytest.raises(ValueError, match=f"backend '{missing}' is not available"):
                module(batch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_from_torch_with_lengths_matches_packed_sequence(backend):
    torch.manual_seed(1)
    gru = torch.nn.GRU(5, 8, bidirectional=True).double()
    layer = dk.nn.DeepTransitionGRU.from_torch(gru, backend=backend)
    lengths = torch.tensor([6, 2, 4])
    x = torch.randn(6, 3, 5, dtype=torch.double)
    out, h_n = layer(x, lengths=lengths)
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
    out_p, h_p = gru(packed)
    out_t, _ = torch.nn.utils.rnn.pad_packed_sequence(out_p, total_length=6)
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(h_n, h_p)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("enforce_sorted", [False, True])
def test_takes_a_packed_sequence_as_torch_gru_does(backend, bidirectional, enforce_sorted):
    """A PackedSequence in, a PackedSequence out of the same batch sizes and order; h0 and h_n in the batch's
    own order; the output, h_n and every gradient those of torch.nn.GRU (float64)."""
    torch.manual_seed(2)
    gru = torch.nn.GRU(5, 7, bidirectional=bidirectional, batch_first=True).double()
    layer = dk.nn.DeepTransitionGRU.from_torch(gru, backend=backend)   # (batch_first: a packed x has no layout)
    D = 2 if bidirectional else 1
    lengths = torch.tensor([6, 6, 4, 3, 1] if enforce_sorted else [4, 6, 1, 6, 3])
    x = torch.randn(6, 5, 5, dtype=torch.double, requires_grad=True)
    h0 = torch.randn(D, 5, 7, dtype=torch.double, requires_grad=True)
    runs = []
    for module in (layer, gru):
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted)
        out, h_n = module(packed, h0)
        assert isinstance(out, torch.nn.utils.rnn.PackedSequence)
        assert torch.equal(out.batch_sizes, packed.batch_sizes)
        for got, want in ((out.sorted_indices, packed.sorted_indices), (out.unsorted_indices, packed.unsorted_indices)):
            assert (got is None) == (want is None) and (got is None or torch.equal(got, want))
        g = torch.autograd.grad((out.data * torch.arange(out.data.numel(), dtype=torch.double).view_as(out.data)
                                 .sin()).sum() + (h_n * h_n).sum(), [x, h0])
        runs.append((out.data, h_n, *g))
    for ours, torchs, what in zip(runs[0], runs[1], ("output", "h_n", "x's gradient", "h0's gradient")):
        torch.testing.assert_close(ours, torchs, msg=lambda m: f"{what}: {m}")
    # a deep transition layer: the packed run is the padded run with the lengths, in the batch's order
    deep = make_layer("lgru", 4, 6, depth=2, layer_norm=True, bidirectional=bidirectional, backend=backend)
    xs = torch.randn(6, 5, deep.input_size, dtype=torch.double)
    out_p, h_p = deep(torch.nn.utils.rnn.pack_padded_sequence(xs, lengths, enforce_sorted=enforce_sorted))
    out, h_n = deep(xs, lengths=lengths)
    torch.testing.assert_close(torch.nn.utils.rnn.pad_packed_sequence(out_p, total_length=6)[0], out)
    torch.testing.assert_close(h_p, h_n)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layer", ["dt", "atr", "functional"])
def test_padding_reaches_no_gradient_whatever_its_values(backend, layer):
    """A padded step's input is never read (torch.nn.GRU over a PackedSequence): NaN or Inf padding (a batch built
    with torch.empty), or 1e30 under layer norm, made every weight's gradient NaN, and on the reference backend the
    real tokens' too (a hostile-input review, 2026-12-06). Now the outputs and every gradient are those of zero
    padding, to the bit, on every backend: the layers and functional.transition_sequence."""
    T, B, I, H = 4, 3, 3, 4
    results = []
    for pad in (0.0, float("nan"), float("inf"), -1e30):
        torch.manual_seed(0)
        m = (dk.nn.ATR(I, H, backend=backend) if layer == "atr" else
             dk.nn.DeepTransitionGRU(I, H, depth=1, bidirectional=layer == "dt", backend=backend)).double()
        x = torch.randn(T, B, I, dtype=torch.double)
        x[2:, 1], x[1:, 2] = pad, pad
        x.requires_grad_()
        if layer == "functional":
            mask = dk.functional.lengths_to_mask([4, 2, 1], T, B, torch.double, x.device)
            out, h_n = dk.functional.transition_sequence(x, torch.zeros(B, H, dtype=torch.double),
                                                         m.direction_weights(0), mask=mask, backend=backend)
        else:
            out, h_n = m(x, lengths=[4, 2, 1])
        (out.square().sum() + h_n.sum()).backward()
        results.append([out, h_n, x.grad] + [p.grad for p in m.parameters() if p.grad is not None])
    assert all(t.isfinite().all() for t in results[0])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_a_packed_sequence_with_lengths_or_bad_data_is_a_value_error():
    layer = dk.nn.DeepTransitionGRU(4, 3, depth=1)
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(3, 2, 4), torch.tensor([3, 2]))
    with pytest.raises(ValueError, match="PackedSequence holds its own lengths"):
        layer(packed, lengths=[3, 2])
    with pytest.raises(ValueError, match=r"input_size=4, got \[5, 5\]"):
        layer(torch.nn.utils.rnn.pack_padded_sequence(torch.randn(3, 2, 5), torch.tensor([3, 2])))
    with pytest.raises(ValueError, match="x.data has dtype torch.float64"):
        layer(torch.nn.utils.rnn.pack_padded_sequence(torch.randn(3, 2, 4).double(), torch.tensor([3, 2])))
    with pytest.raises(ValueError, match=r"h0 must have shape"):
        layer(packed, torch.randn(1, 3, 3))
    layer.flatten_parameters()   # (torch.nn.GRU's; nothing to do here: code written for it runs unchanged)
    assert layer.num_layers == 1   # (torch.nn.GRU's, which code sizing h0 reads)
    # a PackedSequence made by hand, not by pack_padded_sequence: a RuntimeError from deep inside, or a wrong run
    P = torch.nn.utils.rnn.PackedSequence
    for bad, message in (((packed.data[:-1], packed.batch_sizes), "batch_sizes sum to 5 but data has 4 rows"),
                         ((packed.data, torch.tensor([1, 2, 2])), r"non-increasing, got \[1, 2, 2\]"),
                         ((packed.data, torch.tensor([2, 2, 0, 1])), "positive and non-increasing"),
                         ((packed.data, packed.batch_sizes.float()), "1-D int64 CPU tensor"),
                         ((packed.data, packed.batch_sizes, torch.tensor([0, 0]), torch.tensor([0, 1])),
                          "sorted_indices must be a permutation of the batch's 2 sequences"),
                         ((packed.data, packed.batch_sizes, torch.tensor([1, 0]), torch.tensor([1, 0, 2])),
                          "unsorted_indices must be a permutation")):
        with pytest.raises(ValueError, match="x is no PackedSequence that torch.nn.utils.rnn.pack_padded_sequence "
                                             "or pack_sequence makes: .*" + message):
            layer(P(*bad))


@pytest.mark.parametrize("cls, kwargs", [
    (dk.nn.DeepTransitionGRU, dict(depth=1, bidirectional=True)), (dk.nn.DeepTransitionGRUCell, dict(depth=2)),
    (dk.nn.ATR, dict(layer_norm=True)), (dk.nn.ATRCell, {}),
], ids=["layer", "cell", "atr", "atr-cell"])
def test_factory_arguments_as_torch_modules_take_them(cls, kwargs):
    """device= and dtype= as every torch.nn module takes them (torch.nn.utils.skip_init and the meta device
    build with them): the parameters made there, the same names and shapes; a dtype that is no floating point is
    refused in one line."""
    def make(**more):
        return cls(3, 4, **kwargs, **more)

    plain = make()
    made = make(dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in made.parameters())
    meta = make(device="meta")
    assert all(p.is_meta for p in meta.parameters())
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in plain.named_parameters()]
    skipped = torch.nn.utils.skip_init(cls, 3, 4, **kwargs)   # (made on the meta device, then left uninitialised)
    assert [(n, p.shape) for n, p in skipped.named_parameters()] == [(n, p.shape) for n, p in plain.named_parameters()]
    for bad in (torch.int64, "float64"):
        with pytest.raises(ValueError, match=rf"dtype must be a floating-point torch.dtype, got {bad!r}"):
            make(dtype=bad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cell,depth,layer_norm", [("gru", 0, False), ("lgru", 2, True), ("lau", 1, False),
                                                   ("atr", 0, False), ("atr", 0, True)])
def test_bias_false_is_the_layer_with_zero_biases(backend, cell, depth, layer_norm):
    """bias=False (torch.nn.GRU's flag): no gate-bias parameters; outputs and the other parameters' gradients are
    those of the same layer with its biases zero, to the bit, for a layer and a cell."""
    torch.manual_seed(5)
    make = (lambda **kw: dk.nn.ATR(5, 6, layer_norm=layer_norm, bidirectional=True, backend=backend, **kw)) \
        if cell == "atr" else (lambda **kw: dk.nn.DeepTransitionGRU(5, 6, depth=depth, cell=cell, layer_norm=layer_norm,
                                                                    bidirectional=True, backend=backend, **kw))
    ours, full = make(bias=False).double(), make().double()
    assert not any("bias" in n and "ln_" not in n for n, _ in ours.named_parameters())
    with torch.no_grad():
        for n, p in full.named_parameters():
            p.copy_(getattr(ours, n)) if hasattr(ours, n) else p.zero_()
    x, lengths = torch.randn(7, 3, 5, dtype=torch.double), torch.tensor([7, 4, 1])
    g = torch.randn(7, 3, 12, dtype=torch.double)
    (out, h), (out_f, h_f) = ours(x, lengths=lengths), full(x, lengths=lengths)
    assert torch.equal(out, out_f) and torch.equal(h, h_f)
    grads = torch.autograd.grad((out * g).sum(), list(ours.parameters()))
    grads_f = torch.autograd.grad((out_f * g).sum(), [getattr(full, n) for n, _ in ours.named_parameters()])
    for a, b in zip(grads, grads_f):
        assert torch.equal(a, b)
    one = (dk.nn.ATRCell(5, 6, layer_norm=layer_norm, backend=backend, bias=False) if cell == "atr" else
           dk.nn.DeepTransitionGRUCell(5, 6, depth=depth, cell=cell, layer_norm=layer_norm, backend=backend,
                                       bias=False)).double()
    one.load_state_dict({n[:-len("_reverse")]: p for n, p in ours.state_dict().items() if n.endswith("_reverse")})
    step = one(x[0], torch.zeros(3, 6, dtype=torch.double))
    assert "bias=False" in repr(one)
    back = ours(x[:1].flip(0))[0][0, :, 6:]   # (the reverse direction's one step over x[0])
    torch.testing.assert_close(step, back)
    with pytest.raises(ValueError, match="bias must be True or False"):
        make(bias="no")


def test_from_torch_without_bias_and_bad_inputs():
    gru = torch.nn.GRU(3, 4, bias=False)
    layer = dk.nn.DeepTransitionGRU.from_torch(gru)
    x = torch.randn(5, 2, 3)
    torch.testing.assert_close(layer(x)[0], gru(x)[0], atol=1e-6, rtol=1e-5)
    # the GRU's mode and frozen weights carry over (an eval() GRU gave a layer in training mode, every weight wanting
    # a gradient); a bias-free GRU gives a bias-free layer: its zero biases had been parameters, which
    # requires_grad_() or a state_dict loaded into a new layer made train, leaving the torch GRU's function
    assert layer.training and layer.weight_hh.requires_grad and not layer.bias
    assert [n for n, _ in layer.named_parameters()] == ["weight_ih", "weight_hh"]
    layer.requires_grad_(True)
    opt, opt_t = torch.optim.SGD(layer.parameters(), lr=0.5), torch.optim.SGD(gru.parameters(), lr=0.5)
    for m, o in ((layer, opt), (gru, opt_t)):
        m(x)[0].square().sum().backward()
        o.step()
    torch.testing.assert_close(layer(x)[0], gru(x)[0], atol=1e-6, rtol=1e-5)   # (trained alike, the same still)
    copy = dk.nn.DeepTransitionGRU(3, 4, depth=0, cell="gru", layer_norm=False, bias=False)
    copy.load_state_dict(layer.state_dict())
    torch.testing.assert_close(copy(x)[0], gru(x)[0], atol=1e-6, rtol=1e-5)
    gru.eval().weight_ih_l0.requires_grad_(False)
    frozen = dk.nn.DeepTransitionGRU.from_torch(gru)
    assert not frozen.training and not frozen.weight_ih.requires_grad and frozen.weight_hh.requires_grad
    with pytest.raises(ValueError, match="num_layers=2"):
        dk.nn.DeepTransitionGRU.from_torch(torch.nn.GRU(3, 4, num_layers=2))
    with pytest.raises(ValueError, match="torch.nn.GRU"):
        dk.nn.DeepTransitionGRU.from_torch(torch.nn.LSTM(3, 4))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False])
def test_cell_from_torch_reproduces_torch_gru_cell(backend, bias):
    torch.manual_seed(3)
    torch_cell = torch.nn.GRUCell(6, 9, bias=bias).double()
    cell = dk.nn.DeepTransitionGRUCell.from_torch(torch_cell, backend=backend)
    assert (cell.cell, cell.depth, cell.layer_norm, cell.backend) == ("gru", 0, False, backend)
    x = torch.randn(4, 6, dtype=torch.double, requires_grad=True)
    h = torch.randn(4, 9, dtype=torch.double, requires_grad=True)
    for ours, torchs in ((cell(x, h), torch_cell(x, h)), (cell(x), torch_cell(x)), (cell(x[0], h[0]),
                                                                                    torch_cell(x[0], h[0]))):
        torch.testing.assert_close(ours, torchs)
    torch.testing.assert_close(cell(x, hx=h), torch_cell(x, hx=h))   # (torch.nn.GRUCell's keyword)
    with pytest.raises(ValueError, match="DeepTransitionGRUCell: give the initial state once"):
        cell(x, h, hx=h)
    g = torch.randn(4, 9, dtype=torch.double)
    grads = torch.autograd.grad((cell(x, h) * g).sum(), [x, h, cell.weight_ih, cell.weight_hh])
    grads_t = torch.autograd.grad((torch_cell(x, h) * g).sum(), [x, h, torch_cell.weight_ih, torch_cell.weight_hh])
    for ours, torchs in zip(grads, grads_t):
        torchs = torchs.clone()
        if torchs.dim() == 2 and torchs.shape[0] == 27:   # (the update gate's rows, negated as from_torch does)
            torchs[9:18] = -torchs[9:18]
        torch.testing.assert_close(ours, torchs)
    assert cell.bias == bias and hasattr(cell, "bias_ih") == bias
    with pytest.raises(ValueError, match="expected a torch.nn.GRUCell, got GRU"):
        dk.nn.DeepTransitionGRUCell.from_torch(torch.nn.GRU(6, 9))


@pytest.mark.parametrize("backend", BACKENDS)
def test_parametrized_weights_and_replicas_run_as_torch_grus_do(backend):
    """A layer computes with the weights its attributes give, as torch.nn.GRU does: a weight_norm parametrization,
    pruning and nn.DataParallel's replicas (plain tensors where the parameters were) each raised a KeyError from
    the parameter dictionary. Float64, against torch.nn.GRU with the same parametrization, and a step cell in an
    `unrolled` block (new weights at each read) against the reference backend."""
    import contextlib
    import copy

    import torch.nn.utils.prune

    torch.manual_seed(4)
    x = torch.randn(5, 2, 3, dtype=torch.double)
    gru = torch.nn.GRU(3, 4).double()
    layer = dk.nn.DeepTransitionGRU.from_torch(gru, backend=backend)
    torch.nn.utils.parametrizations.weight_norm(gru, "weight_hh_l0")
    torch.nn.utils.parametrizations.weight_norm(layer, "weight_hh")
    runs = []
    for module, name in ((layer, "weight_hh"), (gru, "weight_hh_l0")):
        out, h_n = module(x)
        originals = list(getattr(module.parametrizations, name).parameters())   # (the norms g and the directions v)
        runs.append((out, h_n, *torch.autograd.grad(out.sin().sum() + h_n.sum(), originals)))
    for ours, torchs in zip(runs[0], runs[1]):
        if ours.shape == (12, 4):   # (v: the update gate's rows negated, as from_torch negates them; g, their norms,
            torchs = torch.cat([torchs[:4], -torchs[4:8], torchs[8:]])   # the same)
        torch.testing.assert_close(ours, torchs)
    # pruning: the layer computes with its masked weight
    pruned = make_layer("lgru", 3, 4, depth=1, layer_norm=True, backend=backend)
    zeroed = copy.deepcopy(pruned)
    torch.nn.utils.prune.l1_unstructured(pruned, "tgru1_weight_hh", amount=0.5)
    with torch.no_grad():
        zeroed.tgru1_weight_hh.mul_(pruned.tgru1_weight_hh_mask)
    for a, b in zip(pruned(x), zeroed(x)):
        torch.testing.assert_close(a, b)
    # a replica as nn.DataParallel makes one: plain tensors in place of the parameters, gradients reaching them
    source = make_layer("atr", 3, 4, layer_norm=True, bidirectional=True, backend=backend)
    replica = source._replicate_for_data_parallel()
    for name, p in source._parameters.items():
        setattr(replica, name, p * 1)
    for a, b in zip(replica(x), source(x)):
        torch.testing.assert_close(a, b)
    replica(x)[0].sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in source.parameters())
    # a weight-normed step cell in an unrolled block: its weights are read anew at each step
    cells = [dk.nn.DeepTransitionGRUCell(3, 4, depth=1, backend=b).double() for b in (backend, "reference")]
    cells[1].load_state_dict(cells[0].state_dict())
    grads = []
    for cell in cells:
        torch.nn.utils.parametrizations.weight_norm(cell, "weight_hh")
        h, states = torch.zeros(2, 4, dtype=torch.double), []
        with dk.nn.unrolled(cell):
            for t in range(5):
                h = cell(x[t], h)
                states.append(h)
        grads.append(torch.autograd.grad(torch.stack(states).sin().sum(), list(cell.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    # its norms changed in place within the block: the steps after it read the new weights (the block's cached
    # weights are those of the tensors read, whose versions a parametrization's new tensor does not carry)
    cell = cells[0]
    g = cell.parametrizations.weight_hh.original0
    finals = []
    for block in (dk.nn.unrolled(cell), contextlib.nullcontext()):
        with torch.no_grad():
            g.fill_(1.0)
        h = torch.zeros(2, 4, dtype=torch.double)
        with block:
            for t in range(5):
                if t == 2:
                    with torch.no_grad():
                        g.mul_(3.0)
                h = cell(x[t], h)
        finals.append(h)
    torch.testing.assert_close(finals[0], finals[1])


@pytest.mark.parametrize("make", [
    lambda: make_layer("lgru", 5, 6, depth=2, layer_norm=True, bidirectional=True, dtype=torch.float32),
    lambda: make_layer("lau", 5, 6, depth=1, layer_norm=False, dtype=torch.float32),
    lambda: make_layer("atr", 5, 6, layer_norm=True, bidirectional=True, dtype=torch.float32),
], ids=["lgru", "lau", "atr"])
def test_backend_switch_on_live_module(make):
    layer = make()
    keys = list(layer.state_dict())
    x = torch.randn(7, 3, 5)
    h0 = torch.randn(layer.num_directions, 3, 6, requires_grad=True)
    results = []
    for backend in BACKENDS:
        layer.backend = backend
        assert list(layer.state_dict()) == keys
        layer.zero_grad()
        h0.grad = None
        out, h_n = layer(x, h0, lengths=[7, 3, 5])
        (out.sum() + h_n.pow(2).sum()).backward()
        results.append([out, h_n, h0.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_state_dict_is_shared_across_backends():
    a = make_layer("lgru", 4, 5, depth=2, layer_norm=True, bidirectional=True, backend="cpp")
    b = dk.nn.DeepTransitionGRU(4, 5, depth=2, cell="lgru", layer_norm=True, bidirectional=True,
                                backend="reference").double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 2, 4, dtype=torch.double)
    torch.testing.assert_close(a(x)[0], b(x)[0])


def test_parameter_names_and_shapes():
    layer = dk.nn.DeepTransitionGRU(4, 6, depth=2, cell="lgru", layer_norm=True, bidirectional=True)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes["weight_ih"] == (30, 4) and shapes["weight_hh"] == (24, 6)
    assert shapes["bias_ih"] == (12,) and shapes["bias_hh"] == (6,)          # candidate (+ linear) rows only
    assert shapes["ln_weight"] == (18,) and shapes["tgru2_ln_bias_reverse"] == (12,)
    assert shapes["tgru1_weight_hh"] == (18, 6) and shapes["tgru1_bias_hh"] == (6,)
    gru = dk.nn.DeepTransitionGRU(4, 6, depth=0, cell="gru", layer_norm=False)
    assert {n: tuple(p.shape) for n, p in gru.named_parameters()} == {
        "weight_ih": (18, 4), "weight_hh": (18, 6), "bias_ih": (18,), "bias_hh": (18,)}
    atr = dk.nn.ATR(4, 6)
    assert {n: tuple(p.shape) for n, p in atr.named_parameters()} == {
        "weight_ih": (6, 4), "weight_hh": (6, 6), "bias_hh": (6,)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_unbatched_and_h0_gradient(backend):
    layer = make_layer("gru", 3, 4, depth=1, bidirectional=True, backend=backend, batch_first=True)
    x = torch.randn(2, 5, 3, dtype=torch.double)
    h0 = torch.randn(2, 2, 4, dtype=torch.double, requires_grad=True)
    out, h_n = layer(x, h0)
    assert out.shape == (2, 5, 8) and h_n.shape == (2, 2, 4)
    # the last forward output and the first backward output are the final states
    torch.testing.assert_close(out[:, -1, :4], h_n[0])
    torch.testing.assert_close(out[:, 0, 4:], h_n[1])
    h_n.sum().backward()
    assert h0.grad is not None and h0.grad.abs().sum() > 0
    out_u, h_u = layer(x[0], h0[:, 0].detach())
    torch.testing.assert_close(out_u, out[0])
    torch.testing.assert_close(h_u, h_n[:, 0])


def test_candidate_dropout_is_fixed_over_time_and_off_in_eval():
    """DTMT's candidate dropout (paper 000): one mask per sequence and transition, multiplying the candidate
    at every step (the pure recurrence run with that mask, step by step), 0 or 1/keep at the rate asked; in eval
    mode none (the recurrence without a mask)."""
    from dtmt_kernels.ops.transition import reference as ref

    layer = make_layer("lgru", 3, 4, depth=1, candidate_dropout=0.5, dtype=torch.float64)
    x = torch.randn(5, 2, 3, dtype=torch.double)
    w, h0 = layer.direction_weights(0), torch.zeros(2, 4, dtype=torch.double)
    layer.eval()
    assert layer.sample_dropout_masks(2) is None
    torch.testing.assert_close(layer(x)[0], ref.transition_sequence(x, h0, w)[0], rtol=1e-12, atol=1e-12)
    layer.train()
    torch.manual_seed(11)
    mask = layer.sample_dropout_masks(2, x)                         # what the layer draws first from this seed
    assert mask.shape == (2, 2, 4) and set(mask.unique().tolist()) == {0.0, 2.0}
    expected = ref.transition_sequence(x, h0, w, drop=mask)[0]
    assert not torch.allclose(expected, ref.transition_sequence(x, h0, w)[0])
    for backend in BACKENDS:
        layer.backend = backend
        torch.manual_seed(11)
        torch.testing.assert_close(layer(x)[0], expected, rtol=1e-12, atol=1e-12, msg=backend)
    # the rate: 1 - candidate_dropout of the units kept
    layer.candidate_dropout = 0.3
    big = layer.sample_dropout_masks(4000)
    kept = (big > 0).double().mean().item()
    assert abs(kept - 0.7) < 0.01 and torch.equal(big[big > 0], torch.full_like(big[big > 0], 1 / 0.7))


def _err(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()


def test_lengths_to_mask_and_unpadded_batches():
    """lengths_to_mask: [T, B] ones at real steps; with none_if_unpadded None exactly when every length is T (the
    layers then run the kernels' no-mask path: the same outputs as with the all-ones mask, to the bit)."""
    from dtmt_kernels.functional import lengths_to_mask

    mask = lengths_to_mask(torch.tensor([3, 1]), 3, 2, torch.float32, torch.device("cpu"))
    assert torch.equal(mask, torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]]))
    assert lengths_to_mask([3, 3], 3, 2, torch.float32, torch.device("cpu"), none_if_unpadded=True) is None
    assert lengths_to_mask(torch.tensor([3, 2]), 3, 2, torch.float32, torch.device("cpu"),
                           none_if_unpadded=True) is not None
    layer = dk.nn.DeepTransitionGRU(3, 4, depth=1, bidirectional=True).eval()
    x = torch.randn(5, 2, 3)
    with torch.no_grad():
        unmasked = layer(x, lengths=[5, 5])
        masked = dk.functional.transition_sequence   # (the layer's own path with an explicit all-ones mask:)
        for d, reverse in ((0, False), (1, True)):
            w = layer.direction_weights(d, dict(layer.named_parameters()))
            out, h_n = masked(x, torch.zeros(2, 4), w, torch.ones(5, 2), None, reverse, layer.backend)
            assert torch.equal(out, unmasked[0][..., 4 * d:4 * d + 4]) and torch.equal(h_n, unmasked[1][d])


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_a_parameter_apart_from_the_others_is_named(backend):
    """Contract §3: a bad input is a ValueError naming it. The inputs are checked against weight_hh; a layer or cell
    with one parameter loaded onto the meta device, or converted alone where the op then fails, failed with torch's
    message, which names no parameter ("Tensor on device meta is not on the expected device cpu!", "self and mat2
    must have the same dtype"). Each backend's layer and cell now names it. (The C++ ops take a layer norm's
    float64 parameter as float32: the whole layer's result, to the bit.)"""
    for make, x in ((lambda: dk.nn.DeepTransitionGRU(5, 6, depth=2, backend=backend), torch.randn(4, 3, 5)),
                    (lambda: dk.nn.DeepTransitionGRUCell(5, 6, depth=2, backend=backend), torch.randn(3, 5)),
                    (lambda: dk.nn.ATR(5, 6, backend=backend), torch.randn(4, 3, 5))):
        for apart, said, which in ((lambda t: torch.empty(t.shape, device="meta"), "torch.float32 on meta", -1),
                                   (lambda t: t.detach().double(), "torch.float64 on cpu", -1),
                                   (lambda t: t.detach().double(), "torch.float64 on cpu", 1)):   # (weight_hh: named
            torch.manual_seed(0)                                                                # as the odd one)
            layer = make()
            whole = layer(x)
            name = [n for n, _ in layer.named_parameters()][which]
            setattr(layer, name, torch.nn.Parameter(apart(getattr(layer, name))))
            try:
                out = layer(x)
            except ValueError as exc:
                assert re.fullmatch(rf"{type(layer).__name__}: parameter {name} is {said} but the others are "
                                    rf"torch.float32 on cpu; move or convert the whole layer \(layer.to\(...\)\)",
                                    str(exc)), str(exc)
                continue
            assert said.endswith("cpu") and backend == "cpp" and "ln_" in name, (name, said)
            for a, b in zip(out if isinstance(out, tuple) else [out], whole if isinstance(whole, tuple) else [whole]):
                assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_a_parameter_of_the_wrong_shape_is_named(backend):
    """A parameter whose shape is not the layer's (put by torch.func.functional_call or an assignment) ran on the
    reference backend, a bias of one value broadcast over H, and failed inside the C++ op in its own names (b_hh
    for bias_hh) after a dozen frames: the same ValueError on both, naming the parameter and its shape, for the
    layers and cells, both directions, and the unrolled steps."""
    from torch.func import functional_call
    from dtmt_kernels.unrolled import unrolled

    cases = [(dk.nn.ATR(4, 5), "bias_hh", torch.randn(2, 3, 4)),
             (dk.nn.DeepTransitionGRU(4, 5, depth=2, bidirectional=True), "tgru2_bias_hh_reverse",
              torch.randn(2, 3, 4)),
             (dk.nn.DeepTransitionGRUCell(4, 5, depth=1), "tgru1_bias_hh", torch.randn(3, 4)),
             (dk.nn.ATRCell(4, 5, layer_norm=False), "bias_hh", torch.randn(3, 4)),
             (dk.nn.DeepTransitionGRU(4, 5, depth=0, layer_norm=False), "weight_ih", torch.randn(2, 3, 4))]
    for module, name, x in cases:
        module.backend = backend
        want = dict(module.named_parameters())[name].shape
        bad = torch.full((1,), 0.7) if "bias" in name else torch.randn(want[0], want[1] + 1)
        message = f"{type(module).__name__}: parameter {name} must be {list(want)} (input_size 4, hidden_size 5), " \
                  f"got {list(bad.shape)}"
        _err(lambda: functional_call(module, {**dict(module.named_parameters()), name: bad}, (x,)), re.escape(message))
        setattr(module, name, torch.nn.Parameter(bad))
        _err(lambda: module(x), re.escape(message))
        if isinstance(module, dk.nn.ATRCell) or isinstance(module, dk.nn.DeepTransitionGRUCell):
            with unrolled(module):
                _err(lambda: module(x.requires_grad_()), re.escape(message))
    # the helpers' arguments: direction_weights(-1) had read the reverse direction, 2 was an IndexError;
    # sample_dropout_masks(True) a mask for batch 1, -1 and 2.5 torch's errors
    layer = dk.nn.DeepTransitionGRU(4, 5, depth=1, candidate_dropout=0.1, bidirectional=True)
    for bad in (-1, 2, 1.0, True):
        _err(lambda: layer.direction_weights(bad), f"DeepTransitionGRU: direction must be 0 or 1, got {bad!r}")
        _err(lambda: layer.kernel_params(bad), "direction must be 0 or 1")
    _err(lambda: dk.nn.ATR(4, 5).direction_weights(1), r"ATR: direction must be 0 \(the layer has one direction\)")
    for bad in (-1, 2.5, True, "2", torch.tensor(True), torch.tensor(2.0)):
        _err(lambda: layer.sample_dropout_masks(bad), re.escape(f"DeepTransitionGRU: batch_size must be an int >= 0, "
                                                                f"got {bad!r}"))
    import numpy as np   # (numpy's integers, as torch.nn takes them)
    assert layer.sample_dropout_masks(np.int64(3)).shape == (2, 3, 5) == layer.sample_dropout_masks(3).shape
    assert torch.equal(layer.direction_weights(np.int64(1)).w_hh, layer.weight_hh_reverse)
    assert torch.equal(layer.direction_weights(1).w_hh, layer.weight_hh_reverse)


def test_bad_inputs_raise_value_errors():
    layer = dk.nn.DeepTransitionGRU(3, 4, depth=1, bidirectional=True)
    x = torch.randn(5, 2, 3)
    _err(lambda: layer(torch.randn(5, 2, 7)), r"input_size=3")
    _err(lambda: layer(torch.randn(5, 2, 3, 1)), r"\[T, B, input_size\]")
    _err(lambda: layer(x.double()), "dtype")
    _err(lambda: layer(torch.ones(5, 2, 3, dtype=torch.long)), "floating-point")
    _err(lambda: layer(x.to("meta")), "meta")
    _err(lambda: layer([[1.0]]), "must be a Tensor")
    _err(lambda: layer(torch.randn(0, 2, 3)), "at least one step")   # (B = 0: torch.nn.GRU's empty answer)
    _err(lambda: layer(x, torch.randn(1, 2, 4)), r"h0 must have shape \[num_directions, B, hidden_size\]")
    _err(lambda: layer(x, lengths=[5, 0]), r"in \[1, T=5\]")
    _err(lambda: layer(x, lengths=[5, 6]), r"in \[1, T=5\]")
    _err(lambda: layer(x, lengths=[5]), "one entry per sequence")
    _err(lambda: layer(x, lengths=torch.tensor([5.0, 2.0])), "integers")
    _err(lambda: layer(x, lengths=torch.tensor([[5, 2]])), "1-D")
    _err(lambda: layer(torch.randn(5, 3), lengths=[5]), "unbatched")
    _err(lambda: layer(x, lengths=[[5], [2]]), r"lengths must hold integers, got \[\[5\], \[2\]\]")
    _err(lambda: layer(x, lengths=[True, True]), "lengths must hold integers")
    _err(lambda: layer(x, lengths=5), "lengths must be a 1-D tensor or sequence of ints")
    # no order of the rows: a set ({5, 3} was taken as [3, 5]) or a dict's keys
    _err(lambda: layer(x, lengths={5, 3}), r"lengths must be a 1-D tensor or sequence of ints \[B=2\], got set")
    _err(lambda: layer(x, lengths={5: 0, 3: 0}), "lengths must be a 1-D tensor or sequence of ints")
    _err(lambda: layer(x, lengths="53"), "lengths must be a 1-D tensor or sequence of ints")
    _err(lambda: layer(x, lengths={5: 0, 3: 0}.keys()), "got dict_keys")
    assert torch.equal(layer(x, lengths=(n for n in (5, 3)))[0], layer(x, lengths=[5, 3])[0])   # (an order: taken)
    _err(lambda: layer(x, lengths=[2 ** 64, 5]), r"every length must be in \[1, T=5\], got min 5, max "
                                                 "18446744073709551616")
    _err(lambda: layer(x, lengths=torch.tensor([5, 2], device="meta")), "meta tensor")
    import numpy as np   # numpy numbers and one-element tensors are lengths too
    expected = layer(x, lengths=[5, 2])[0]
    for lengths in ([np.float32(5), 2], [np.int64(5), np.int64(2)], np.array([5, 2]), (5, 2),
                    [torch.tensor(5), torch.tensor(2)]):
        assert torch.equal(layer(x, lengths=lengths)[0], expected)
    _err(lambda: dk.nn.DeepTransitionGRU(3, 4, cell="lstm"), "cell must be 'gru', 'lgru' or 'lau', got 'lstm'$")
    _err(lambda: dk.nn.DeepTransitionGRUCell(3, 4, cell="atr"), "got 'atr'; use dtmt_kernels.nn.ATRCell")
    _err(lambda: dk.nn.DeepTransitionGRU(3, 0), "hidden_size")
    _err(lambda: dk.nn.DeepTransitionGRU(3, 4, depth=-1), "depth")
    _err(lambda: dk.nn.DeepTransitionGRU(3, 4, depth=2 ** 40), "depth must be an int from 0 to 256, got 1099511627776")
    _err(lambda: dk.nn.DeepTransitionGRU(2 ** 63, 4), "input_size must be an int from 1 to 2,147,483,647")
    _err(lambda: dk.nn.DeepTransitionGRU(3, 4, candidate_dropout=1.0), "candidate_dropout")
    _err(lambda: dk.nn.DeepTransitionGRU(3, 4, candidate_dropout="x"), "candidate_dropout must be a number")
    _err(lambda: dk.nn.DeepTransitionGRUCell(3, 4, candidate_dropout=None), "candidate_dropout must be a number")
    # set after construction too (1.0 made every output NaN in training: 0 / 0; 2.0 torch's bernoulli_ message)
    for module in (dk.nn.DeepTransitionGRU(3, 4, candidate_dropout=0.25), dk.nn.DeepTransitionGRUCell(3, 4)):
        before = module.candidate_dropout
        for bad in (1.0, 2.0, -0.1, "0.5", True):
            _err(lambda: setattr(module, "candidate_dropout", bad),
                 f"{type(module).__name__}: candidate_dropout must be a number in \\[0, 1\\), got {bad!r}")
            assert module.candidate_dropout == before
        module.candidate_dropout = np.float32(0.5)
        assert module.candidate_dropout == 0.5 and type(module.candidate_dropout) is float
    # ATR has no candidate: a rate, or a step's mask, was taken and changed nothing (a review found it); refused
    for module in (dk.nn.ATR(3, 4), dk.nn.ATRCell(3, 4)):
        _err(lambda: setattr(module, "candidate_dropout", 0.5), f"{type(module).__name__}: ATR has no candidate to "
                                                                 f"drop \\(contract §2\\); candidate_dropout must be 0")
        module.candidate_dropout = 0
        assert module.candidate_dropout == 0.0
    _err(lambda: dk.nn.ATRCell(3, 4)(torch.ones(2, 3), torch.zeros(2, 4), torch.zeros(1, 2, 4)),
         "ATRCell: ATR has no candidate to drop \\(contract §2\\); pass no drop mask")
    # a layer pickled whole by an earlier version: candidate_dropout (and backend, before BackendSwitch) under their
    # plain names, no `bias` flag (before bias=False; forward and repr were an AttributeError): it loads and runs
    old = dk.nn.DeepTransitionGRU(3, 4, candidate_dropout=0.25, backend="reference")
    for renamed, unbiased in ((("candidate_dropout",), False), (("candidate_dropout", "backend"), True)):
        state = dict(old.__dict__)
        for name in renamed:
            state[name] = state.pop(f"_{name}")
        if unbiased:
            del state["bias"]
        loaded = object.__new__(type(old))
        loaded.__setstate__(state)
        assert loaded.candidate_dropout == 0.25 and loaded.backend == "reference" and loaded.bias is True
        assert not {"candidate_dropout", "backend"} & set(loaded.__dict__) and repr(loaded) == repr(old)
        assert torch.equal(loaded.eval()(torch.ones(2, 1, 3))[0], old.eval()(torch.ones(2, 1, 3))[0])
    _err(lambda: dk.nn.DeepTransitionGRU(3, 4, backend="fast"), "backend must be one of")
    # switches: a bool, numpy's, or 0 / 1 as torch.nn.GRU takes them (layer_norm="no" had meant True)
    _err(lambda: dk.nn.DeepTransitionGRU(3, 4, layer_norm="no"), "layer_norm must be True or False, got 'no'")
    _err(lambda: dk.nn.ATRCell(3, 4, layer_norm=None), "ATRCell: layer_norm must be True or False, got None")
    _err(lambda: dk.nn.ATR(3, 4, bidirectional="yes"), "bidirectional must be True or False")
    _err(lambda: dk.nn.DeepTransitionGRU(3, 4, batch_first=2), "batch_first must be True or False, got 2")
    assert not dk.nn.DeepTransitionGRU(3, 4, layer_norm=np.False_, bidirectional=np.int64(1), batch_first=0).layer_norm
    _err(lambda: setattr(layer, "backend", "nope"), "backend must be one of")
    cell = dk.nn.DeepTransitionGRUCell(3, 4, depth=1)
    _err(lambda: cell(torch.randn(2, 5)), "input_size=3")
    _err(lambda: cell(torch.randn(2, 3), torch.randn(3, 4)), r"\[B, hidden_size\]")
    _err(lambda: cell(torch.randn(2, 3), drop=torch.ones(1, 2, 4)), "depth\\+1")
    # a drop mask of another dtype or device: refused (on the meta device the cpp step read garbage)
    _err(lambda: cell(torch.randn(2, 3), drop=torch.ones(2, 2, 4, dtype=torch.float64)), "drop has dtype")
    _err(lambda: cell(torch.randn(2, 3), drop=torch.ones(2, 2, 4, device="meta")), "drop is on meta")
    _err(lambda: cell(torch.randn(2, 3), drop="none"), "drop must be a Tensor")
    h = torch.randn(2, 4)   # the state by its name in contract §3 (h1 = cell(x, h0))
    assert torch.equal(cell(x[0], h0=h), cell(x[0], h))


@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_transition_refuses_bad_arguments_on_every_backend(backend):
    """dk.functional.transition_sequence / transition_step check their arguments themselves, the same on every
    backend: before, the cpp backend took an h0 of another dtype (and returned h_n in it) where the reference
    refused, the reference took a 1-D mask, a drop of the wrong depth and reverse="no" (reading right to left)
    where the cpp op refused them or printed its schema, and transition_step of a 3-D x returned [T, B, H]."""
    F_ = dk.functional
    layer = dk.nn.DeepTransitionGRU(3, 4, depth=1)
    w = layer.direction_weights(0)
    x, h0 = torch.randn(5, 2, 3), torch.zeros(2, 4)
    expected = F_.transition_sequence(x, h0, w, backend=backend)
    for args, kwargs, match in [
            ((x, h0.double(), w), {}, "h0 has dtype torch.float64 but x has torch.float32"),
            ((x, h0, w, torch.ones(5)), {}, r"mask must be a Tensor \[T=5, B=2\], got \[5\]"),
            ((x, h0, w, None, torch.ones(1, 2, 4)), {}, r"drop must be a Tensor \[depth\+1=2, B=2, H=4\], got"),
            ((x, h0, w), {"reverse": "no"}, "reverse must be True or False, got 'no'"),
            ((x, h0, w), {"eps": float("nan")}, "eps must be a finite number >= 0, got nan"),
            ((x, h0, w), {"eps": -1.0}, "eps must be a finite number >= 0"),
            ((x, torch.zeros(3, 4), w), {}, r"h0 must be a Tensor \[B=2, H=4\], got \[3, 4\]"),
            ((x[..., :2], h0, w), {}, r"x must be \[T, B, input_size=3\] with T, B >= 1, got \[5, 2, 2\]"),
            ((x, h0, "w"), {}, "weights must be a TransitionWeights, got str"),
            ((x.long(), h0, w), {}, "x must be a floating-point Tensor, got torch.int64")]:
        _err(lambda: F_.transition_sequence(*args, backend=backend, **kwargs), f"transition_sequence: {match}")
    _err(lambda: F_.transition_step(x, h0, w, backend=backend), r"transition_step: x must be a Tensor \[B, "
                                                                 r"input_size=3\] with B >= 1, got \[5, 2, 3\]")
    _err(lambda: F_.transition_step(x[0, :, :2], h0, w, backend=backend), r"input_size=3\] with B >= 1, got \[2, 2\]")
    _err(lambda: F_.transition_step(x[0], h0[:1], w, backend=backend), r"transition_step: h must be a Tensor")
    # malformed weights: refused the same on every backend (a T-GRU's lone layer norm ran differently per backend,
    # a layer-norm bias without its weight was skipped by the reference, a meta weight gave made-up values there,
    # others failed deep inside: KeyError, IndexError, torch.stack's message)
    from dataclasses import replace

    normed = dk.nn.DeepTransitionGRU(3, 4, depth=2, cell="gru", layer_norm=True).direction_weights(0)
    for bad, match in [
            (replace(normed, t_ln_w=[None, normed.t_ln_w[1]], t_ln_b=[None, normed.t_ln_b[1]]),
             r"weights.t_ln_w must give a layer norm for every T-GRU or for none"),
            (replace(normed, ln_w=None), "weights.ln_w and ln_b must both be given or both be None"),
            (replace(normed, cell="lstm"), "weights.cell must be one of gru, lgru, lau, atr, got 'lstm'"),
            (replace(normed, t_b=normed.t_b[:1]), r"weights.t_w, t_b, t_ln_w and t_ln_b must have one entry "
                                                  r"per T-GRU \(2; a layer norm's None where there is none\), got "
                                                  r"2, 1, 2, 2"),
            (replace(normed, t_w=[normed.t_w[0][:6], normed.t_w[1]]),
             r"weights.t_w\[0\] must be a floating-point Tensor \[12, 4\] for cell 'gru' \(H = 4\), got \[6, 4\]"),
            (replace(normed, b_ih=normed.b_ih[None]), r"weights.b_ih must be a floating-point Tensor \[12\]"),
            (replace(normed, w_ih=normed.w_ih.to("meta")), "weights.w_ih is on meta but x is on cpu"),
            (replace(normed, w_hh=normed.w_hh.double()), "weights.w_hh has dtype torch.float64 but x has "
                                                         "torch.float32"),
            (replace(normed, w_hh=normed.w_hh[:0, :0]), r"weights.w_hh must be a floating-point Tensor \[3H, H\]"),
            (replace(normed, b_hh=None), r"weights.b_hh must be a floating-point Tensor \[12\] for cell 'gru' "
                                         r"\(H = 4\), got NoneType")]:
        _err(lambda: F_.transition_sequence(x, h0, bad, backend=backend), f"transition_sequence: {match}")
        _err(lambda: F_.transition_step(x[0], h0, bad, backend=backend), f"transition_step: {match}")
    atr = dk.nn.ATR(3, 4).direction_weights(0)   # (ATR's drop mask was taken and changed nothing, as in its layers)
    for call in (lambda: F_.transition_sequence(x, h0, atr, drop=torch.ones(1, 2, 4), backend=backend),
                 lambda: F_.transition_step(x[0], h0, atr, drop=torch.ones(1, 2, 4), backend=backend)):
        _err(call, "ATR has no candidate to drop")
    _err(lambda: F_.transition_sequence(x, h0, replace(atr, t_w=[normed.t_w[0]], t_b=[normed.t_b[0]],
                                                       t_ln_w=[None], t_ln_b=[None]), backend=backend),
         "weights.cell 'atr' takes no T-GRUs")
    # what passes is what the layer computes; a step is the sequence's first
    layer.backend = backend
    assert torch.equal(expected[0], layer(x)[0])
    # a mask of bool or of another floating dtype says the same; numpy's bool and 1 are a reverse
    import numpy as np
    mask = torch.tensor([[1, 1]] * 3 + [[1, 0]] * 2)
    masked = F_.transition_sequence(x, h0, w, mask.float(), backend=backend)
    for other in (mask.bool(), mask.double()):
        assert all(torch.equal(a, b) for a, b in zip(F_.transition_sequence(x, h0, w, other, backend=backend), masked))
    _err(lambda: F_.transition_sequence(x, h0, w, mask, backend=backend), "mask must be bool or floating point, got "
                                                                         "torch.int64")
    backward = F_.transition_sequence(x, h0, w, reverse=True, backend=backend)
    for flag in (np.bool_(True), 1):
        assert torch.equal(F_.transition_sequence(x, h0, w, reverse=flag, backend=backend)[0], backward[0])
    torch.testing.assert_close(F_.transition_step(x[0], h0, w, backend=backend), expected[0][0])


def test_unavailable_backend_is_an_error_not_a_fallback():
    layer = dk.nn.ATR(3, 4)
    x = torch.randn(2, 1, 3)
    for name in ("triton", "cuda"):
        if name in dk.available_backends():
            continue
        layer.backend = name
        _err(lambda: layer(x), f"backend '{name}' is not available")


@pytest.mark.parametrize("backend", BACKENDS)
def test_reverse_unidirectional_layer_is_the_backward_half(backend):
    bi = make_layer("lau", 3, 4, depth=1, layer_norm=True, bidirectional=True, backend=backend, batch_first=True)
    rev = dk.nn.DeepTransitionGRU(3, 4, depth=1, cell="lau", layer_norm=True, batch_first=True, reverse=True,
                                  backend=backend).double()
    rev.load_state_dict({k.replace("_reverse", ""): v for k, v in bi.state_dict().items() if "_reverse" in k})
    x = torch.randn(3, 6, 3, dtype=torch.double)
    lengths = [6, 2, 4]
    out_bi, h_bi = bi(x, lengths=lengths)
    out_rev, h_rev = rev(x, lengths=lengths)
    torch.testing.assert_close(out_rev, out_bi[..., 4:])
    torch.testing.assert_close(h_rev[0], h_bi[1])
    with pytest.raises(ValueError, match="unidirectional"):
        dk.nn.ATR(3, 4, bidirectional=True, reverse=True)


def test_inference_path_matches_autograd_path_and_sees_weight_updates():
    """Under no_grad the cpp backend skips autograd and caches its flat weights; it must give the same
    numbers, and notice in-place updates (optimizer steps, load_state_dict) and moves."""
    torch.manual_seed(3)
    for layer in (dk.nn.DeepTransitionGRU(5, 7, depth=2, cell="lgru", layer_norm=True, bidirectional=True),
                  dk.nn.DeepTransitionGRUCell(5, 7, depth=1, cell="lau", layer_norm=False),
                  dk.nn.ATR(5, 7, layer_norm=True)):
        x = torch.randn(4, 3, 5) if not isinstance(layer, dk.nn.DeepTransitionGRUCell) else torch.randn(3, 5)
        for _ in range(2):
            with_grad = layer(x)
            with torch.no_grad():
                without = layer(x)
            for a, b in zip(with_grad if isinstance(with_grad, tuple) else (with_grad,),
                            without if isinstance(without, tuple) else (without,)):
                assert torch.equal(a.detach(), b)
            with torch.no_grad():                       # an in-place update, as optimizer.step() does
                for p in layer.parameters():
                    p.add_(0.1 * torch.randn_like(p))
        with torch.no_grad():
            before = layer(x)
            layer.load_state_dict({k: v + 1 for k, v in layer.state_dict().items()})
            after = layer(x)
        first = lambda r: r[0] if isinstance(r, tuple) else r  # noqa: E731
        assert not torch.equal(first(before), first(after))
        assert torch.equal(first(after), first(layer(x)).detach())


def test_options_after_the_sizes_are_keywords_only():
    """A review: torch.nn.GRU(4, 5, 2) is num_layers=2, and the layers read the same call as depth=2 (ATR(4, 5, 1,
    False, True) as layer_norm and bidirectional), without a word. The options after input_size and hidden_size are
    keywords only, so a torch.nn.GRU call is refused, not read as other options."""
    for make in (lambda: dk.nn.DeepTransitionGRU(4, 5, 2), lambda: dk.nn.DeepTransitionGRUCell(4, 5, True),
                 lambda: dk.nn.ATR(4, 5, 1, False, True), lambda: dk.nn.ATRCell(4, 5, False)):
        with pytest.raises(TypeError, match="positional argument"):
            make()
    layer = dk.nn.DeepTransitionGRU(4, 5, depth=2, cell="gru", layer_norm=False)
    assert layer.depth == 2 and not layer.layer_norm
