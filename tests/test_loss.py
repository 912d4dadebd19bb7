"""The training loss: `smoothed_cross_entropy` (log-softmax and label-smoothed loss fused, from logits) is the
same function as `label_smoothed_nll` of `torch.log_softmax`, values and gradients, and a system's
`forward(..., target=)` (what `dtmt train` calls) equals the loss of its log-probabilities."""
import pytest
import torch

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
    g_half, = torch.autograd.grad(loss, half)
    assert g_half.dtype == torch.bfloat16


def test_fused_loss_rejects_bad_smoothing():
    logits, target = _random_case(0, torch.float32)
    with pytest.raises(ValueError, match="smoothing"):
        smoothed_cross_entropy(logits, target, 1.0)


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
