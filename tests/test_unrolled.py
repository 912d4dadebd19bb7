"""dk.nn.unrolled: step cells whose weight gradients are formed once over all steps (autograd.UnrolledSteps).

Checked against the pure-PyTorch reference backend (outputs, input / state / every parameter gradient), in
float64 and float32, for every cell kind, with and without T-GRUs, layer norm and candidate dropout."""
import contextlib
import copy
import threading

import pytest
import torch

import dtmt_kernels as dk

pytestmark = pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")

CASES = [("gru", 0, False), ("gru", 2, True), ("lgru", 1, True), ("lgru", 0, False), ("lau", 2, True),
         ("lau", 1, False), ("atr", None, False), ("atr", None, True)]


def make_cell(cell, depth, ln, dtype, seed=0, candidate_dropout=0.2):
    torch.manual_seed(seed)
    if cell == "atr":
        return dk.nn.ATRCell(5, 6, layer_norm=ln).to(dtype)
    return dk.nn.DeepTransitionGRUCell(5, 6, depth=depth, cell=cell, layer_norm=ln,
                                       candidate_dropout=candidate_dropout).to(dtype)


def unroll(cell, xs, h0, drop, weights, backend, use_block):
    """Runs the cell over xs [T, B, I] from h0 and returns (sum_t <weights_t, h_t>, the states [T, B, H])."""
    cell.backend = backend
    outs = []
    with dk.nn.unrolled(cell) if use_block else torch.enable_grad():
        h = h0
        for t in range(xs.shape[0]):
            h = cell(xs[t], h, drop)
            outs.append(h)
    out = torch.stack(outs)
    return (out * weights).sum(), out


def grads_of(cell, xs, h0, drop, weights, backend, use_block):
    cell.zero_grad()
    xs_, h0_ = xs.clone().requires_grad_(), h0.clone().requires_grad_()
    loss, out = unroll(cell, xs_, h0_, drop, weights, backend, use_block)
    loss.backward()
    return [out.detach(), xs_.grad, h0_.grad] + [None if p.grad is None else p.grad.clone() for p in cell.parameters()]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cell_name,depth,ln", CASES)
def test_unrolled_matches_the_reference(cell_name, depth, ln, dtype):
    cell = make_cell(cell_name, depth, ln, dtype)
    g = torch.Generator().manual_seed(1)
    T, B = 7, 3
    xs = torch.randn(T, B, 5, generator=g, dtype=dtype)
    h0 = torch.randn(B, 6, generator=g, dtype=dtype)
    weights = torch.randn(T, B, 6, generator=g, dtype=dtype)
    cell.train()
    torch.manual_seed(2)
    drop = cell.sample_dropout_masks(B, xs) if cell_name != "atr" else None
    ref = grads_of(cell, xs, h0, drop, weights, "reference", False)
    fused = grads_of(cell, xs, h0, drop, weights, "cpp", True)
    with dk.nn.unrolled(cell):   # the block really takes the unrolled path
        assert type(cell(xs[0], h0, drop).grad_fn).__name__.startswith("CppTransitionStepFunction")
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
    assert len(ref) == len(fused)
    for a, b in zip(ref, fused):
        torch.testing.assert_close(b, a, **tol)
    plain = grads_of(cell, xs, h0, drop, weights, "cpp", False)   # the step-by-step cpp path agrees too
    for a, b in zip(plain, fused):
        torch.testing.assert_close(b, a, **tol)


def test_unrolled_gradcheck():
    """float64 gradcheck of the unrolled steps, through x, h0 and the parameters (passed functionally)."""
    cell = make_cell("lgru", 1, True, torch.float64, candidate_dropout=0.0)   # no fresh masks per call
    names = [n for n, _ in cell.named_parameters()]
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(4, 2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in cell.parameters()]

    def f(xs, h0, *ps):
        # the block builds its flat weights from the module's parameters: run with them replaced by the inputs
        saved = {n: cell._parameters[n] for n in names}
        try:
            for n, v in zip(names, ps):
                cell._parameters[n] = v
            return unroll(cell, xs, h0, None, torch.ones(4, 2, 6, dtype=torch.float64), "cpp", True)[1]
        finally:
            cell._parameters.update(saved)

    assert torch.autograd.gradcheck(f, (xs, h0, *params))


def lgru_case():
    """A float64 lgru cell without dropout, 5 steps of 2 rows, and its unrolled gradients from one backward."""
    cell = make_cell("lgru", 1, True, torch.float64, candidate_dropout=0.0)
    xs = torch.randn(5, 2, 5, dtype=torch.float64)
    h0 = torch.zeros(2, 6, dtype=torch.float64)
    w = torch.randn(5, 2, 6, dtype=torch.float64)
    once = grads_of(cell, xs, h0, None, w, "cpp", True)
    cell.zero_grad()
    return cell, xs, h0, w, once


def test_retain_graph_runs_twice_without_double_counting():
    cell, xs, h0, w, once = lgru_case()
    loss, _ = unroll(cell, xs, h0, None, w, "cpp", True)
    loss.backward(retain_graph=True)
    loss.backward()
    for a, p in zip(once[3:], cell.parameters()):
        torch.testing.assert_close(p.grad, 2 * a)


def test_a_pass_that_does_not_reach_the_weights_leaves_nothing_behind():
    """torch.autograd.grad of the input only runs the steps but not the weights' node; a later full backward
    must not add that pass's rows in."""
    cell, xs, h0, w, once = lgru_case()
    xs_ = xs.clone().requires_grad_()
    loss, _ = unroll(cell, xs_, h0, None, w, "cpp", True)
    (dx,) = torch.autograd.grad(loss, xs_, retain_graph=True)
    torch.testing.assert_close(dx, once[1])
    loss.backward()
    for a, p in zip(once[3:], cell.parameters()):
        torch.testing.assert_close(p.grad, a)


def test_a_later_pass_over_fewer_steps_uses_only_its_own_rows():
    """A pass that ran every step's backward without reaching the weights, then a backward of a loss that reaches
    only the first three steps: the weight gradients are that loss's alone (the plain step-by-step path's), none
    of the first pass's rows of the later steps."""
    cell, xs, h0, w, _ = lgru_case()

    def states(use_block, xs_):
        hs = []
        with dk.nn.unrolled(cell) if use_block else torch.enable_grad():
            h = h0
            for t in range(xs.shape[0]):
                h = cell(xs_[t], h)
                hs.append(h)
        return hs

    cell.backend = "cpp"
    xs_ = xs.clone().requires_grad_()
    hs = states(True, xs_)
    torch.autograd.grad((hs[-1] * w[-1]).sum(), xs_, retain_graph=True)   # steps 4..0, not the weights
    (hs[2] * w[2]).sum().backward()                                        # steps 2..0 and the weights
    got = [p.grad.clone() for p in cell.parameters()]
    cell.zero_grad()
    (states(False, xs)[2] * w[2]).sum().backward()
    for g, p in zip(got, cell.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_frozen_weights_and_several_rounds_in_one_block():
    """Frozen parameters: input gradients as the plain path's, nothing kept for the weights. Truncated
    backpropagation (forward, backward, optimizer step, again, all in one block): each round's gradients equal
    the plain path's with the same weights."""
    cell = make_cell("gru", 2, True, torch.float64, candidate_dropout=0.0)
    xs = torch.randn(4, 2, 5, dtype=torch.float64)
    h0 = torch.randn(2, 6, dtype=torch.float64)
    w = torch.randn(4, 2, 6, dtype=torch.float64)
    cell.requires_grad_(False)
    plain = grads_of(cell, xs, h0, None, w, "cpp", False)
    xs_ = xs.clone().requires_grad_()
    with dk.nn.unrolled(cell):
        loss, _ = unroll(cell, xs_, h0, None, w, "cpp", False)
        steps = cell._unrolled_sessions()[(xs.device, xs.dtype)][0]
    loss.backward()
    torch.testing.assert_close(xs_.grad, plain[1])
    assert steps.rows == {}
    cell.requires_grad_(True)
    opt = torch.optim.SGD(cell.parameters(), lr=0.1)
    twin = make_cell("gru", 2, True, torch.float64, candidate_dropout=0.0)
    with dk.nn.unrolled(cell):
        for _ in range(3):
            twin.load_state_dict(cell.state_dict())
            expected = grads_of(twin, xs, h0, None, w, "cpp", False)
            opt.zero_grad()
            loss, _ = unroll(cell, xs, h0, None, w, "cpp", False)   # inside the outer block
            loss.backward()
            for a, p in zip(expected[3:], cell.parameters()):
                torch.testing.assert_close(p.grad, a)
            opt.step()


@pytest.mark.parametrize("order", ["first-first", "second-first"])
def test_two_sequences_in_one_block_each_with_its_own_backward(order):
    """Micro-batches: two sequences run in one block, then a backward of each (gradient accumulation). They share
    the block's session and its weights' node, and the second backward failed ("Trying to backward through the
    graph a second time": the node's saved tensors were freed by the first). Each backward now adds its own
    sequence's gradients, the sum equal to the plain path's, for the cell and for the attention context; and a
    backward run twice over the same steps is still an error, as on the plain path."""
    cell = make_cell("lgru", 1, True, torch.float64, candidate_dropout=0.0)
    owner = _Owner()
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(2, 4, 3, 5, generator=g, dtype=torch.float64)
    values = torch.randn(3, 7, 6, generator=g, dtype=torch.float64)
    logits = torch.randn(2, 4, 3, 1, 7, generator=g, dtype=torch.float64)

    def sequence(s, backend, v):
        cell.backend, h, out = backend, torch.zeros(3, 6, dtype=torch.float64), 0
        for t in range(4):
            h = cell(xs[s, t], h)
            out = out + (h * dk.nn.step_context(owner, torch.softmax(logits[s, t], -1), v, backend)).sum()
        return out * (s + 1)

    v = values.clone().requires_grad_()
    (sequence(0, "reference", v) + sequence(1, "reference", v)).backward()
    expected = [p.grad.clone() for p in cell.parameters()] + [v.grad]
    cell.zero_grad()
    v = values.clone().requires_grad_()
    with dk.nn.unrolled(cell, owner):
        losses = [sequence(0, "cpp", v), sequence(1, "cpp", v)]
    for loss in (losses if order == "first-first" else losses[::-1]):
        loss.backward()
    for got, want in zip([p.grad for p in cell.parameters()] + [v.grad], expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        losses[0].backward()


def test_threads_running_one_cell_each_have_their_own_block():
    """Several threads run the same cell and attention owner at once, each in its own `unrolled` block (opened in
    thread order; a barrier makes their steps interleave; thread s leaves its block after s + 1 steps while the
    others step on).
    Each block has its own sessions, and each thread's gradients equal its sequence's alone on the reference
    backend. Before, the block lived on the module: the other threads took the first's sessions, and where their
    backward passes overlapped the gradients were wrong (15 to 31 relative, in about half the runs)."""
    cell = make_cell("lgru", 2, True, torch.float64, candidate_dropout=0.0)
    owner = _Owner()
    n, T = 4, 5
    g = torch.Generator().manual_seed(6)
    xs = torch.randn(n, T, 3, 5, generator=g, dtype=torch.float64)
    values = torch.randn(n, 3, 7, 6, generator=g, dtype=torch.float64)
    logits = torch.randn(n, T, 3, 1, 7, generator=g, dtype=torch.float64)
    barrier = threading.Barrier(n, timeout=60)
    turns = [threading.Event() for _ in range(n + 1)]   # thread s opens its block after thread s - 1
    turns[0].set()
    sessions = [None] * n   # each thread's sessions in its block (held: no id reused)

    def gradients(s, backend, wait):
        v = values[s].clone().requires_grad_()
        with contextlib.ExitStack() as block:
            if backend == "cpp":
                assert turns[s].wait(60)
                block.enter_context(dk.nn.unrolled(cell, owner))
                sessions[s] = (cell._unrolled_sessions(), owner._unrolled_sessions())
                turns[s + 1].set()
            h, out = torch.zeros(3, 6, dtype=torch.float64), 0
            for t in range(T):
                wait()
                if t == s + 1:
                    block.close()   # thread s leaves its block after s + 1 steps, while the others step on
                h = cell(xs[s, t], h)
                out = out + (h * dk.nn.step_context(owner, torch.softmax(logits[s, t], -1), v, backend)).sum()
        wait()
        return torch.autograd.grad(out, [v, *cell.parameters()])

    cell.backend = "reference"
    expected = [gradients(s, "reference", lambda: None) for s in range(n)]
    cell.backend = "cpp"
    got = [None] * n

    def run(s):
        try:
            got[s] = gradients(s, "cpp", barrier.wait)
        except BaseException:
            barrier.abort()   # (the others stop waiting)
            raise

    threads = [threading.Thread(target=run, args=(s,)) for s in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i in range(n):   # each block its own (before, every thread after the first took the first's)
        assert all(a is not None for a in sessions[i]), i
        assert all(sessions[i][k] is not sessions[j][k] for j in range(i) for k in (0, 1)), i
    for s in range(n):
        assert got[s] is not None, f"thread {s} failed"
        for a, b in zip(got[s], expected[s]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert cell._unrolled_sessions() is None and owner._unrolled_sessions() is None   # every block closed


def test_a_block_closed_on_another_thread_closes_the_opener_s():
    """A generator that holds a block may be closed (or collected) on another thread: the block it closes is its
    opener's, never the closing thread's own block on the same cell."""
    cell = make_cell("gru", 0, False, torch.float64)

    def holder():
        with dk.nn.unrolled(cell):
            yield

    held = holder()
    next(held)
    assert cell._unrolled_sessions() is not None
    seen = []

    def other():
        with dk.nn.unrolled(cell):
            mine = cell._unrolled_sessions()
            held.close()
            seen.append(mine is not None and cell._unrolled_sessions() is mine)

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert seen == [True] and cell._unrolled_sessions() is None


@pytest.mark.parametrize("cell,depth,ln", [("gru", 0, False), ("lgru", 2, True)])
def test_a_pass_that_starts_below_a_partial_pass_takes_only_its_own_rows(cell, depth, ln):
    """A backward pass that never reaches the weights (the saliency of the last step: autograd.grad to its input)
    leaves its step's rows; a later pass that starts below them (a loss on the earlier steps) is told apart by its
    graph task. Before, only the order of the steps told passes apart, and the left rows went into the weight
    gradients (up to 1.65 off the reference's; a probe of torch's machinery)."""
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(4, 2, 5, generator=g, dtype=torch.float64)
    h0 = torch.randn(2, 6, generator=g, dtype=torch.float64)
    got = {}
    for backend in ("reference", "cpp"):
        c = make_cell(cell, depth, ln, torch.float64, candidate_dropout=0.0)
        c.backend = backend
        x = [xs[t].clone().requires_grad_() for t in range(4)]
        with dk.nn.unrolled(c):
            h, outs = h0, []
            for t in range(4):
                h = c(x[t], h)
                outs.append(h)
        saliency, = torch.autograd.grad(outs[3].sum(), [x[3]], retain_graph=True)
        sum((o ** 2).sum() for o in outs[:3]).backward()
        got[backend] = [saliency, *(p.grad for p in c.parameters())]
    for a, b in zip(got["cpp"], got["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_vmap_over_an_ensemble_of_cells_in_a_block_runs_the_plain_steps():
    """torch.func.vmap of functional_call over stacked cells inside an unrolled block (what vmap over a whole system
    does: its forward opens the block): the steps run as the plain op, which vmap batches, and outputs and
    gradients equal the reference's. Before, the session's Function had no vmap rule: torch's message about
    setup_context, naming no op."""
    from torch.func import functional_call, stack_module_state, vmap

    cells = [make_cell("lgru", 1, True, torch.float64, seed=s, candidate_dropout=0.0) for s in range(3)]
    params, _ = stack_module_state(cells)
    base = copy.deepcopy(cells[0]).to("meta")
    xs = torch.randn(3, 2, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def step(p, x, h):
        return functional_call(base, p, (x, h))

    got = {}
    for backend in ("reference", "cpp"):
        base.backend = backend
        with dk.nn.unrolled(base):
            h, outs = torch.zeros(3, 2, 6, dtype=torch.float64), []
            for t in range(3):
                h = vmap(step, in_dims=(0, None, 0))(params, xs[t], h)
                outs.append(h)
        out = torch.stack(outs)
        got[backend] = [out, *torch.autograd.grad((out ** 2).sum(), list(params.values()))]
    for a, b in zip(got["cpp"], got["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)



@pytest.mark.parametrize("inside", [True, False], ids=["backward-in-block", "backward-after-block"])
def test_non_reentrant_checkpoint_steps_in_a_block(inside):
    """torch.utils.checkpoint (non-reentrant) of each step inside an unrolled block, its backward inside the block
    or after it has closed: the gradients of the steps without a block, and of the reference. After the block,
    the recomputation took the plain op where the forward had taken the unrolled one, and checkpoint refused it
    ("Recomputed values ... have different metadata"); under saved-tensor hooks the steps are the plain op."""
    from torch.utils.checkpoint import checkpoint

    cell = make_cell("lgru", 1, True, torch.float64, seed=3, candidate_dropout=0.0)
    xs = torch.randn(4, 2, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    got = {}
    for backend, block in (("cpp", True), ("cpp", False), ("reference", False)):
        cell.backend = backend
        cell.zero_grad()
        h0 = torch.zeros(2, 6, dtype=torch.float64, requires_grad=True)
        with dk.nn.unrolled(cell) if block else contextlib.nullcontext():
            h = h0
            for t in range(4):
                h = checkpoint(cell, xs[t], h, use_reentrant=False)
            if inside:
                (h ** 2).sum().backward()
        if not inside:
            (h ** 2).sum().backward()
        got[backend, block] = [h0.grad, *(p.grad for p in cell.parameters())]
    for key in (("cpp", False), ("reference", False)):
        for a, b in zip(got["cpp", True], got[key]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_block_given_a_model_opens_the_cells_inside_it():
    """unrolled(model) opens every Unrollable module inside the model (a container given alone had opened nothing,
    without a word: the steps ran the plain op); the steps' gradients are those of the plain steps."""
    cell = make_cell("lgru", 1, True, torch.float64, seed=6, candidate_dropout=0.0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 5).double(), torch.nn.ModuleList([cell]))
    xs = torch.randn(4, 2, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = {}
    for block in (True, False):
        model.zero_grad()
        with dk.nn.unrolled(model) if block else contextlib.nullcontext():
            h, kinds = torch.zeros(2, 6, dtype=torch.float64), set()
            for t in range(4):
                h = cell(model[0](xs[t]), h)
                kinds.add(type(h.grad_fn).__name__)
            (h ** 2).sum().backward()
        assert (kinds == {"CppTransitionStepFunctionBackward"}) == block, kinds
        got[block] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(got[True], got[False]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_reentrant_checkpoint_steps_in_a_block():
    """torch.utils.checkpoint's reentrant form recomputes a step during the backward, the block still open: the
    recomputation joined the block's sessions, its nested backward ran their shared weight sink and dropped the rows
    kept for the later steps (weight gradients off by up to 1.8, a review found it; the values' gradient of
    step_context likewise). A forward during a backward is now the plain op: every gradient that of the steps
    without a block."""
    from torch.utils.checkpoint import checkpoint

    cell = make_cell("gru", 1, False, torch.float64, seed=0, candidate_dropout=0.0)
    owner = _Owner()
    g = torch.Generator().manual_seed(5)
    xs, enc = torch.randn(6, 2, 5, generator=g, dtype=torch.float64), torch.randn(2, 4, 6, generator=g,
                                                                                   dtype=torch.float64)
    got = {}
    for block in (True, False):
        cell.zero_grad()
        enc_ = enc.clone().requires_grad_()
        with dk.nn.unrolled(cell, owner) if block else contextlib.nullcontext():
            h, loss = torch.zeros(2, 6, dtype=torch.float64), 0
            for t in range(6):
                h = checkpoint(cell, xs[t], h, use_reentrant=True) if t == 3 else cell(xs[t], h)
                alpha = torch.softmax(h[:, :4], -1).unsqueeze(1)
                ctx = (checkpoint(lambda a: dk.nn.step_context(owner, a, enc_, "cpp"), alpha, use_reentrant=True)
                       if t == 2 else dk.nn.step_context(owner, alpha, enc_, "cpp"))
                loss = loss + (h ** 2).sum() + (ctx ** 2).sum()
            loss.backward()
        got[block] = [enc_.grad, *(p.grad.clone() for p in cell.parameters())]
    for a, b in zip(got[True], got[False]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("change", ["data", "swap"])
def test_weights_given_new_storage_in_a_block_are_read_anew(change):
    """Inside an open block, weights given new values without an in-place op (`p.data = ...`, as weight averaging
    writes it, or torch.utils.swap_tensors, whose version counters may agree): the next step reads them. Before,
    the session's key was each weight's identity and version, which neither changes: the step computed with the
    old weights (0.30 off torch.nn.GRUCell's)."""
    torch.manual_seed(0)
    gru = torch.nn.GRUCell(5, 6).double()
    cell = dk.nn.DeepTransitionGRUCell.from_torch(gru, backend="cpp")
    x = torch.randn(2, 5, dtype=torch.float64)
    with dk.nn.unrolled(cell):
        cell(x)   # (autograd recording: the session begins)
        for module in (cell, gru):
            for p in module.parameters():
                if change == "data":
                    p.data = p.data * 2
                else:
                    with torch.no_grad():
                        twice = torch.nn.Parameter(p * 2)
                        while twice._version < p._version:   # (equal counters, as a probe met them)
                            twice.mul_(1)
                    torch.utils.swap_tensors(p, twice)
        torch.testing.assert_close(cell(x), gru(x), rtol=1e-10, atol=1e-12)


def test_a_weight_changed_before_a_step_backward_is_reported():
    """The steps save the weights they read: an in-place change is caught even where the weights' node does not
    run (a gradient of the input only)."""
    cell = make_cell("lgru", 1, True, torch.float32, candidate_dropout=0.0)
    x = torch.randn(2, 5, requires_grad=True)
    with dk.nn.unrolled(cell):
        h = cell(x, torch.zeros(2, 6))
    with torch.no_grad():
        cell.weight_ih.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(h.sum(), x)


def test_unrolled_leaves_inference_other_backends_and_outside_calls_alone():
    cell = make_cell("gru", 1, True, torch.float32)
    xs = torch.randn(3, 2, 5)
    h0 = torch.randn(2, 6)
    cell.eval()
    with dk.nn.unrolled(cell), torch.no_grad():
        h = cell(xs[0], h0)
    assert h.grad_fn is None
    torch.testing.assert_close(h, cell(xs[0], h0).detach())
    with dk.nn.unrolled(cell):
        inside = cell(xs[0], h0)
        cell.backend = "reference"
        ref = cell(xs[0], h0)
        cell.backend = "cpp"
    assert type(inside.grad_fn).__name__.startswith("CppTransitionStepFunction")
    assert not type(ref.grad_fn).__name__.startswith("CppTransitionStep")
    outside = cell(xs[0], h0)
    assert not type(outside.grad_fn).__name__.startswith("CppTransitionStep")
    torch.testing.assert_close(inside, outside)
    # the backward may run after the block has closed, and gives the plain path's gradients
    inside.sum().backward()
    got = [p.grad.clone() for p in cell.parameters()]
    cell.zero_grad()
    outside.sum().backward()
    for a, p in zip(got, cell.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_parameter_changed_before_backward_is_reported():
    cell = make_cell("lgru", 0, False, torch.float32)
    with dk.nn.unrolled(cell):
        h = cell(torch.randn(2, 5), torch.zeros(2, 6))
    with torch.no_grad():
        cell.weight_hh.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()


class _Owner(dk.nn.Unrollable, torch.nn.Module):
    """A stand-in for an attention module: step_context's sessions live on it."""


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_step_context_matches_the_reference(heads, dtype):
    """Steps of attention contexts against the same (strided) values in an unrolled block: the context, and the
    gradients to the values and to every step's weights, equal those of the reference backend."""
    g = torch.Generator().manual_seed(4)
    B, S, C, T = 3, 5, 8, 6
    enc = torch.randn(S, B, C, generator=g, dtype=dtype)        # time-major: values are a transposed view
    logits = torch.randn(T, B, heads, S, generator=g, dtype=dtype)
    w = torch.randn(T, B, C, generator=g, dtype=dtype)
    owner = _Owner()

    def run(backend, block):
        enc_, logits_ = enc.clone().requires_grad_(), logits.clone().requires_grad_()
        values = (2 * enc_).transpose(0, 1)
        with dk.nn.unrolled(owner) if block else torch.enable_grad():
            ctx = torch.stack([dk.nn.step_context(owner, torch.softmax(logits_[t], -1), values, backend)
                               for t in range(T)])
        (ctx * w).sum().backward()
        return ctx.detach(), enc_.grad, logits_.grad

    ref = run("reference", False)
    fused = run("cpp", True)
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(ref, fused):
        torch.testing.assert_close(b, a, **tol)
    with dk.nn.unrolled(owner):
        v = enc.clone().requires_grad_()
        out = dk.nn.step_context(owner, torch.softmax(logits[0], -1), v.transpose(0, 1), "cpp")
    assert type(out.grad_fn).__name__.startswith("CppContextStepFunction")
    out.sum().backward(retain_graph=True)
    first = v.grad.clone()
    out.sum().backward()                                        # a second backward adds the same again
    torch.testing.assert_close(v.grad, 2 * first)
    with pytest.raises(ValueError, match="attention_context"):
        with dk.nn.unrolled(owner):
            dk.nn.step_context(owner, torch.softmax(logits[0], -1), enc.transpose(0, 1)[:, :4], "cpp")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or "cuda" not in dk.available_backends(),
                    reason="needs a CUDA device and the extension's CUDA kernels")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cell_name,depth,ln", CASES)
def test_gpu_unrolled_matches_the_cuda_step_path(cell_name, depth, ln, dtype, monkeypatch):
    """The cuda backend's cells in an `unrolled` block (transition_backward with weight_grads=False on the device,
    the weight gradients formed once over all steps) against the same cells step by step on the cuda backend
    and against the reference: outputs, input / state gradients and every parameter gradient."""
    monkeypatch.setattr(dk.nn, "UNROLLED_BACKENDS", dk.nn.UNROLLED_BACKENDS | {"cuda"})
    cell = make_cell(cell_name, depth, ln, dtype).cuda().train()
    g = torch.Generator().manual_seed(1)
    T, B = 7, 3
    xs, h0, weights = (torch.randn(*shape, generator=g, dtype=dtype).cuda() for shape in ((T, B, 5), (B, 6), (T, B, 6)))
    torch.manual_seed(2)
    drop = cell.sample_dropout_masks(B, xs) if cell_name != "atr" else None
    steps = grads_of(cell, xs, h0, drop, weights, "cuda", False)
    ref = grads_of(cell, xs, h0, drop, weights, "reference", False)
    fused = grads_of(cell, xs, h0, drop, weights, "cuda", True)
    cell.backend = "cuda"
    with dk.nn.unrolled(cell):   # the block really takes the unrolled path on the device
        assert type(cell(xs[0], h0, drop).grad_fn).__name__.startswith("CppTransitionStepFunction")
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
    for want in (steps, ref):
        for a, b in zip(fused, want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, **tol)


def test_only_the_backends_named_run_unrolled(monkeypatch):
    """UNROLLED_BACKENDS decides which backends' cells take an `unrolled` block's path: without "cpp" in it, a cpp
    cell in a block runs its plain step (the op's own autograd), with the same gradients."""
    cell = make_cell("lgru", 1, True, torch.float64).train()
    g = torch.Generator().manual_seed(3)
    xs, h0, weights = (torch.randn(*shape, generator=g, dtype=torch.float64)
                       for shape in ((4, 2, 5), (2, 6), (4, 2, 6)))
    drop = cell.sample_dropout_masks(2, xs)
    unrolled = grads_of(cell, xs, h0, drop, weights, "cpp", True)
    monkeypatch.setattr(dk.nn, "UNROLLED_BACKENDS", frozenset())
    with dk.nn.unrolled(cell):
        assert not type(cell(xs[0], h0, drop).grad_fn).__name__.startswith("CppTransitionStepFunction")
    for a, b in zip(grads_of(cell, xs, h0, drop, weights, "cpp", True), unrolled):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
