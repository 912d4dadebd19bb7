"""The training loss: `smoothed_cross_entropy` (log-softmax and label-smoothed loss fused, from logits) is the
same function as `label_smoothed_nll` of `torch.log_softmax`, values and gradients, and a system's
`forward(..., target=)` (what `dtmt train` calls) equals the loss of its log-probabilities."""
import pytest
import torch

import dtmt_kernels as dk
from dtmt_models.models.loss import label_smoothed_nll, smoothed_cross_entropy

from test_models import build, toy_batch


def _random_case(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    B, T, V = (int(x) for x in torch.randint(1, 9, (3,), generator=g))
    V += 1
    logits = (3 * torch.randn(B, T, V, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(0, V, (B, T), generator=g)      # id 0 is padding, anywhere (even a whole row)
    return logits, target


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.35])
def test_fused_loss_equals_log_softmax_then_loss(seed, smoothing):
    logits, target = _random_case(seed, torch.float64)
    ref = label_smoothed_nll(torch.log_softmax(logits, -1), target, smoothing)
    got = smoothed_cross_entropy(logits, target, smoothing)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)
    assert got[2] == ref[2] == int((target != 0).sum())
    g_ref, = torch.autograd.grad(ref[0] * 1.7, logits)
    g_got, = torch.autograd.grad(got[0] * 1.7, logits)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda z: smoothed_cross_entropy(z, target, smoothing)[0], (logits,))
    # independently of both: torch's own label-smoothed cross-entropy (the same convention, ε spread over all V)
    V = logits.shape[-1]
    torch_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=0,
                                                   label_smoothing=smoothing, reduction="sum")
    torch_nll = torch.nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=0,
                                                  reduction="sum")
    torch.testing.assert_close(got[0], torch_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], torch_nll, rtol=1e-12, atol=1e-12)
    g_torch, = torch.autograd.grad(torch_loss * 1.7, logits)
    torch.testing.assert_close(g_got, g_torch, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["kernel64", "kernel32",
                                                                                      "portable"])
def test_a_masked_logit_without_smoothing_is_torchs_loss_not_nan(dtype):
    """A logit of -inf (a token masked out) made the loss NaN without label smoothing, in the kernel, the portable
    function and both references: the smoothing term's mean log-probability is -inf, and 0 x inf is NaN (a probe's
    finding). torch's cross_entropy gives the NLL; with smoothing the loss is inf (mass on an impossible token)."""
    logits, target = _random_case(3, torch.float64)
    logits = logits.detach().clone()
    logits[..., -1] = float("-inf")
    target = target.clamp(max=logits.shape[-1] - 2)   # (no target on the masked token)
    V = logits.shape[-1]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=0,
                                                 reduction="sum")
    z = logits.to(dtype).requires_grad_()
    loss, nll, _ = smoothed_cross_entropy(z, target, 0.0)
    tolerance = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(loss.double(), expected.to(torch.float64).to(loss.dtype).double(), **tolerance)
    torch.testing.assert_close(nll, loss)
    grad, = torch.autograd.grad(loss, z)
    assert torch.isfinite(grad).all() and grad[..., -1].abs().max() < 1e-30   # (float32's exp floor: 1e-38)
    for reference in (label_smoothed_nll(torch.log_softmax(logits, -1), target, 0.0),
                      dk.ops.loss.reference.smoothed_cross_entropy(logits.reshape(-1, V), target.reshape(-1), 0.0, 0)):
        torch.testing.assert_close(reference[0], expected)
    assert smoothed_cross_entropy(logits, target, 0.1)[0] == float("inf")


def test_fused_loss_float32_and_bfloat16_logits():
    logits, target = _random_case(3, torch.float32)
    ref = label_smoothed_nll(torch.log_softmax(logits.double(), -1), target, 0.1)
    got = smoothed_cross_entropy(logits, target, 0.1)
    torch.testing.assert_close(got[0].double(), ref[0], rtol=1e-5, atol=1e-5)
    g, = torch.autograd.grad(got[0], logits)
    g_ref, = torch.autograd.grad(ref[0], logits)
    torch.testing.assert_close(g, g_ref.float(), rtol=1e-5, atol=1e-6)
    half = logits.detach().bfloat16().requires_grad_()
    loss = smoothed_cross_entropy(half, target, 0.1)[0]
    assert loss.dtype == torch.float32                    # computed in float32 from bfloat16 logits
    exact = half.detach().double().requires_grad_()       # the bfloat16 values, exactly, in float64
    ref_half = label_smoothed_nll(torch.log_softmax(exact, -1), target, 0.1)[0]
    torch.testing.assert_close(loss.double(), ref_half, rtol=1e-5, atol=1e-5)
    g_half, = torch.autograd.grad(loss, half)
    g_exact, = torch.autograd.grad(ref_half, exact)
    assert g_half.dtype == torch.bfloat16
    torch.testing.assert_close(g_half.double(), g_exact, rtol=1e-2, atol=1e-3)   # the gradient rounded to bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loss_kernel_at_a_real_vocabulary_against_the_reference(dtype):
    """The C++ kernel (CPU float32 / float64) at V = 4,003 (vector loops with a tail), rows left out anywhere:
    the sums against dk.reference.smoothed_cross_entropy in float64 (torch.log_softmax), the gradient against
    autograd through it, and the portable autograd node (other devices and dtypes) against the kernel; the
    results do not depend on the number of threads."""
    import dtmt_kernels as dk
    from dtmt_kernels.ops.loss.op import PortableSmoothedCrossEntropy

    g = torch.Generator().manual_seed(5)
    N, V = 97, 4003
    logits = (5 * torch.randn(N, V, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    target[torch.randint(0, N, (20,), generator=g)] = 1                # id 1 left out
    exact = logits.detach().double().requires_grad_()
    ref = dk.reference.smoothed_cross_entropy(exact, target, 0.1, ignore_index=1)
    ref_grad, = torch.autograd.grad(ref[0] * 0.3, exact)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    before = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            loss, nll = dk.functional.smoothed_cross_entropy(logits, target, 0.1, ignore_index=1)
            grad, = torch.autograd.grad(loss * 0.3, logits)
            runs.append((loss, nll, grad))
    finally:
        torch.set_num_threads(before)
    loss, nll, grad = runs[0]
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    assert loss.dtype == nll.dtype == dtype
    torch.testing.assert_close(loss.double(), ref[0], **tol)
    torch.testing.assert_close(nll.double(), ref[1], **tol)
    torch.testing.assert_close(grad.double(), ref_grad, **tol)
    assert not grad[target == 1].any()
    p_loss, p_nll = PortableSmoothedCrossEntropy.apply(logits, target, 0.1, 1)
    p_grad, = torch.autograd.grad(p_loss * 0.3, logits)
    torch.testing.assert_close(p_loss, loss, **tol)
    torch.testing.assert_close(p_nll, nll, **tol)
    torch.testing.assert_close(p_grad, grad, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["kernel", "portable-f16", "portable-bf16"])
def test_loss_kernel_rejects_a_target_outside_the_vocabulary(dtype):
    """The kernel's message on every CPU path (16-bit logits had gather's "index 5 is out of bounds for dimension
    1"); an ignored row's id is not checked."""
    import dtmt_kernels as dk

    logits, target = torch.randn(3, 5, dtype=dtype), torch.tensor([1, 5, 0])
    with pytest.raises(RuntimeError, match=r"smoothed_cross_entropy: target 5 is outside \[0, 5\)"):
        dk.functional.smoothed_cross_entropy(logits, target, 0.1, ignore_index=0)
    loss, nll = dk.functional.smoothed_cross_entropy(logits, target, 0.1, ignore_index=5)
    torch.testing.assert_close(nll, torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=5,
                                                                      reduction="sum"), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        dk.functional.smoothed_cross_entropy(logits, target[:2])
    # the reference too (the executable spec: it scored an id past the vocabulary as the last one, without a word)
    with pytest.raises(RuntimeError, match=r"smoothed_cross_entropy: target 5 is outside \[0, 5\)"):
        dk.reference.smoothed_cross_entropy(logits, target, 0.1, ignore_index=0)
    torch.testing.assert_close(dk.reference.smoothed_cross_entropy(logits, target, 0.1, ignore_index=5),
                               (loss, nll), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["kernel", "portable"])
def test_loss_refuses_what_is_no_target_or_argument(dtype):
    """A float or bool target is refused as torch's cross_entropy refuses it (the ids were truncated before: 0.9, 1.5
    and 4.99 scored as 0, 1 and 4), on the kernel's path and the portable one, as are a list for logits, a smoothing
    that is no number and an ignore_index past int64 (five lines of the op's schema before)."""
    import dtmt_kernels as dk

    logits = torch.randn(3, 5, dtype=dtype)
    f = dk.functional.smoothed_cross_entropy
    for target in (torch.tensor([0.9, 1.5, 4.99]), torch.tensor([True, False, True])):
        with pytest.raises(ValueError, match=f"target must hold integer ids, got {target.dtype}$"):
            f(logits, target)
    with pytest.raises(ValueError, match="logits and target must be Tensors, got list and Tensor"):
        f(logits.tolist(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="logits must be floating point, got torch.int64"):
        f(torch.ones(3, 5, dtype=torch.long), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"^smoothed_cross_entropy: smoothing must be a number in \[0, 1\), got '0.1'"):
        f(logits, torch.tensor([0, 1, 2]), "0.1")
    with pytest.raises(ValueError, match="ignore_index must be an int64, got 9223372036854775808"):
        f(logits, torch.tensor([0, 1, 2]), 0.1, ignore_index=2 ** 63)
    # no words: the op said it "takes logits [N, V] and target [N]", the shapes it was given
    with pytest.raises(ValueError, match=r"^smoothed_cross_entropy: logits \[3, 0\] score no words: V must be >= 1$"):
        f(torch.randn(3, 0, dtype=dtype), torch.zeros(3, dtype=torch.long))


def test_an_ignore_index_beyond_an_int32_target_s_range_is_compared_as_int64():
    """The portable path (16-bit logits, any device) and the reference compared an int32 target with ignore_index in
    int32: 2**40 wrapped to 0, and the rows of target 0 were left out (1.97 where the kernel gives 9.44). Small integer
    targets (int8) with 16-bit logits failed in gather. Every path now scores them as the kernel does."""
    import dtmt_kernels as dk
    from dtmt_kernels.ops.loss import reference

    torch.manual_seed(0)
    logits = torch.randn(4, 5, dtype=torch.float64)
    for target in (torch.tensor([0, 4, 0, 2], dtype=torch.int32), torch.tensor([0, 4, 0, 2], dtype=torch.int8)):
        expected = -torch.log_softmax(logits, -1)[torch.arange(4), target.long()].sum()   # (no row ignored)
        for got in (dk.functional.smoothed_cross_entropy(logits, target, 0.0, 2 ** 40)[0],
                    reference.smoothed_cross_entropy(logits, target, 0.0, 2 ** 40)[0],
                    dk.functional.smoothed_cross_entropy(logits.bfloat16(), target, 0.0, 2 ** 40)[0].double()):
            torch.testing.assert_close(got, expected, atol=0.1 if got.dtype != logits.dtype else 1e-12, rtol=1e-2)


def test_the_loss_op_s_statistics_want_no_gradient():
    """The op's NLL sum and gradient outputs wanted a gradient, and a backward from them completed leaving the logits'
    None: they are marked as wanting none (nothing flows back through them, as the op's docstring says)."""
    logits = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    loss, nll, grad = torch.ops.dtmt.smoothed_cross_entropy(logits, torch.tensor([1, 4, 0]), 0.1, -100)
    assert loss.requires_grad and not nll.requires_grad and not grad.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        nll.backward()


def test_fused_loss_rejects_bad_smoothing():
    logits, target = _random_case(0, torch.float32)
    with pytest.raises(ValueError, match="smoothing"):
        smoothed_cross_entropy(logits, target, 1.0)


def test_both_losses_refuse_a_pad_id_that_is_no_integer_id():
    """label_smoothed_nll took pad_id=1.5 (no target equals it: every padding position was scored) and True (read as
    id 1); both losses say the argument."""
    logits, target = torch.randn(2, 3, 5), torch.tensor([[1, 2, 0], [0, 0, 0]])
    for pad_id in (1.5, True, None):
        with pytest.raises(ValueError, match="pad_id must be an integer token id"):
            label_smoothed_nll(logits.log_softmax(-1), target, 0.1, pad_id)
        with pytest.raises(ValueError, match="pad_id must be an integer token id"):
            smoothed_cross_entropy(logits, target, 0.1, pad_id)
    assert label_smoothed_nll(logits.log_softmax(-1), target, 0.1, torch.tensor(0).item())[2] == 2


def test_the_loss_op_itself_refuses_smoothing_outside_its_range():
    """torch.ops.dtmt.smoothed_cross_entropy called directly (not through the checking wrapper) returned NaN for a
    NaN smoothing and a number for 5.0: the op checks 0 <= smoothing < 1 itself."""
    logits, target = torch.randn(3, 5), torch.tensor([1, 4, 0])
    for smoothing in (float("nan"), 5.0, 1.0, -0.1):
        with pytest.raises(RuntimeError, match=r"takes 0 <= smoothing < 1, got"):
            torch.ops.dtmt.smoothed_cross_entropy(logits, target, smoothing, -100)
    assert torch.ops.dtmt.smoothed_cross_entropy(logits, target, 0.0, -100)[0].isfinite().all()


def test_the_loss_op_refuses_a_backward_after_its_grad_output_was_modified_in_place():
    """The op returns the gradient its backward reads (and scales in place): a caller's in-place change of that output
    was silently the logits' gradient (zero_() gave zero gradients). Now the backward refuses it; a second backward
    (retain_graph) after the op's own scaling still works."""
    logits, target = torch.randn(3, 5, dtype=torch.float64, requires_grad=True), torch.tensor([1, 4, 0])
    loss, _, grad = torch.ops.dtmt.smoothed_cross_entropy(logits, target, 0.1, -100)
    expected = grad.clone()
    grad.zero_()
    with pytest.raises(RuntimeError, match="grad output, which the backward reads, was modified in place"):
        loss.backward()
    loss, _, grad = torch.ops.dtmt.smoothed_cross_entropy(logits, target, 0.1, -100)
    first, = torch.autograd.grad(2.0 * loss, logits, retain_graph=True)
    second, = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(first, 2.0 * expected)
    torch.testing.assert_close(second, expected)


@pytest.mark.parametrize("name,options", [("dtmt", {}), ("deeplau", {}), ("nematus", {}),
                                          ("transformer", dict(heads=2, encoder_layers=1, decoder_layers=1,
                                                               hidden_size=32))])
def test_forward_with_target_is_the_loss_of_the_log_probs(name, options):
    model = build(name, **options).double().eval()          # eval: no dropout, the two calls see one function
    src, src_lengths, prev, tgt = toy_batch()
    ref = label_smoothed_nll(model(src, src_lengths, prev), tgt, 0.1, model.pad_id)
    ref_grads = torch.autograd.grad(ref[0], list(model.parameters()))
    got = model(src, src_lengths, prev, target=tgt, smoothing=0.1)
    got_grads = torch.autograd.grad(got[0], list(model.parameters()))
    torch.testing.assert_close(got[0], ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-10, atol=1e-10)
    assert got[2] == ref[2]
    for (n, _), a, b in zip(model.named_parameters(), got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=n)
