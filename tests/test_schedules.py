import pytest

from dtmt_models.training.schedules import InverseSqrtSchedule, RNMTPlusSchedule


def test_rnmt_plus_shape():
    f = RNMTPlusSchedule(warmup=500, decay_start=8000, decay_end=64000, n=2)
    assert f(0) == pytest.approx(1.0)
    assert f(250) == pytest.approx(1.25)            # halfway through the warm-up from 1 to n
    assert f(500) == pytest.approx(1.5) and f(1000) == pytest.approx(2.0)   # reaches n at t = n·p
    assert f(3000) == pytest.approx(2.0)
    assert f(4000) == pytest.approx(2.0)            # n·t = s: decay starts
    assert f(32000) == pytest.approx(0.5)           # n·t = e: lr0 / 2
    assert f(40000) == pytest.approx(0.33648, abs=1e-5)   # 2 · 4^((8000 − 80000) / 56000), by hand
    assert RNMTPlusSchedule(8, 800, 8000, n=4)(3800) == pytest.approx(4 * 8 ** -2)   # n (2n)^((s − n t) / (e − s))
    floored = RNMTPlusSchedule(500, 8000, 64000, n=2, floor=0.05)
    assert floored(40000) == pytest.approx(0.33648, abs=1e-5) and floored(10 ** 6) == 0.05   # the floor only below it
    assert RNMTPlusSchedule(n=1)(100) == pytest.approx(1.0)   # one replica: no warm-up
    assert RNMTPlusSchedule(n=1, floor=0.3)(10 ** 7) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        RNMTPlusSchedule(decay_start=10, decay_end=5)
    # a short decay window: (2n)^((s − n t) / (e − s)) before the decay overflowed a float (2^1100 at update 0, an
    # OverflowError's traceback at dtmt train's start), where the min is the other two terms
    short = RNMTPlusSchedule(500, 1100, 1101, n=1)
    assert [short(t) for t in (0, 1100, 1101, 1102)] == [1.0, 1.0, 0.5, 0.25]
    assert RNMTPlusSchedule(500, 1100, 1101, n=4)(10) == pytest.approx(1 + 10 * 3 / 2000)


def test_inverse_sqrt_peak_at_warmup():
    f = InverseSqrtSchedule(model_dim=512, warmup=6000)
    peak = 512 ** -0.5 * 6000 ** -0.5
    assert f(5999) == pytest.approx(peak)
    assert f(2999) == pytest.approx(peak / 2)
    assert f(4 * 6000 - 1) == pytest.approx(peak / 2)
    assert InverseSqrtSchedule(512, 6000, num_gpu=2)(11999) == pytest.approx(peak)
