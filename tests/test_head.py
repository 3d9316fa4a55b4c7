from __future__ import annotations

import numpy as np
import pytest

from edgefl.errors import UpdateRejected
from edgefl.head import (
    Head,
    binary_cross_entropy,
    check_labels,
    cross_entropy,
    cross_entropy_grad_into,
    loss_and_grad,
    sgd_step,
    sigmoid,
    softmax,
    validate_head,
)
from tests.support.models import activate


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    W = rng.normal(0, 0.5, (6, 4)).astype(np.float32)
    b = rng.normal(0, 0.5, 4).astype(np.float32)
    emb = rng.normal(0, 1, (9, 6)).astype(np.float32)
    y = rng.integers(0, 4, 9).astype(np.int64)
    return W, b, emb, y


def test_cross_entropy_gradient_matches_finite_differences() -> None:
    W, b, emb, y = _data()
    _, gW, gb = cross_entropy(W, b, emb, y)
    eps = 1e-3
    W64, b64 = W.astype(np.float64), b.astype(np.float64)

    def loss64(Wx: np.ndarray, bx: np.ndarray) -> float:
        z = emb.astype(np.float64) @ Wx + bx
        z -= z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        return float(-logp[np.arange(len(y)), y].mean())

    for i in range(W.shape[0]):
        for j in range(W.shape[1]):
            Wp, Wm = W64.copy(), W64.copy()
            Wp[i, j] += eps
            Wm[i, j] -= eps
            num = (loss64(Wp, b64) - loss64(Wm, b64)) / (2 * eps)
            assert gW[i, j] == pytest.approx(num, abs=2e-4)
    for j in range(b.shape[0]):
        bp, bm = b64.copy(), b64.copy()
        bp[j] += eps
        bm[j] -= eps
        assert gb[j] == pytest.approx((loss64(W64, bp) - loss64(W64, bm)) / (2 * eps), abs=2e-4)


def test_cross_entropy_grad_into_is_cross_entropys_gradient_bit_for_bit() -> None:
    rng = np.random.default_rng(4)
    W = rng.normal(0, 0.5, (512, 10)).astype(np.float32)
    b = rng.normal(0, 0.5, 10).astype(np.float32)
    emb = rng.normal(0, 1, (32, 512)).astype(np.float32)
    y = rng.integers(0, 10, 32).astype(np.int64)
    _, gW, gb = cross_entropy(W, b, emb, y)
    z, out_W, out_b = np.empty((32, 10), np.float32), np.empty_like(W), np.empty_like(b)
    cross_entropy_grad_into(W, b, emb, y, z, out_W, out_b, np.arange(32, dtype=np.int64))
    assert out_W.tobytes() == gW.tobytes() and out_b.tobytes() == gb.tobytes()
    # z holds (softmax - onehot) / N: each row sums to 0 (to rounding), the label's entry negative
    assert np.allclose(z.sum(axis=1), 0, atol=1e-7) and (z[np.arange(32), y] < 0).all()


def test_cross_entropy_value_by_hand() -> None:
    # two classes, zero weights: p = 0.5 for every sample -> loss ln 2
    W = np.zeros((3, 2), np.float32)
    b = np.zeros(2, np.float32)
    emb = np.ones((4, 3), np.float32)
    loss, _, gb = cross_entropy(W, b, emb, np.array([0, 0, 1, 1]))
    assert loss == pytest.approx(np.log(2), rel=1e-6)
    np.testing.assert_allclose(gb, [0.0, 0.0], atol=1e-7)
    _, _, gb1 = cross_entropy(W, b, emb, np.array([0, 0, 0, 0]))
    np.testing.assert_allclose(gb1, [-0.5, 0.5], atol=1e-7)


def test_sgd_decreases_loss_and_fedprox_pulls_back() -> None:
    W, b, emb, y = _data(1)
    loss0, gW, gb = cross_entropy(W, b, emb, y)
    W1, b1 = W.copy(), b.copy()
    sgd_step(W1, b1, gW, gb, 0.1)
    assert cross_entropy(W1, b1, emb, y)[0] < loss0
    # with W already moved away from W0, the proximal term mu*(W - W0) adds to the step
    W0, b0 = W.copy(), b.copy()
    W2, b2 = (W + 1.0).astype(np.float32), (b + 1.0).astype(np.float32)
    zero_W, zero_b = np.zeros_like(W), np.zeros_like(b)
    sgd_step(W2, b2, zero_W, zero_b, 0.5, prox_mu=1.0, W0=W0, b0=b0)
    np.testing.assert_allclose(W2, W + 0.5, atol=1e-6)
    with pytest.raises(ValueError, match="prox_mu"):
        sgd_step(W2, b2, zero_W, zero_b, 0.5, prox_mu=1.0)


def test_softmax_rows_sum_to_one_and_stable() -> None:
    p = softmax(np.array([[1000.0, 1000.0], [0.0, np.log(3.0)]], np.float32))
    np.testing.assert_allclose(p, [[0.5, 0.5], [0.25, 0.75]], rtol=1e-6)


def test_head_predict_and_validate() -> None:
    W = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    h = Head(W, np.zeros(2, np.float32), 3)
    assert h.predict(np.array([[2.0, 1.0], [0.0, 5.0]], np.float32)).tolist() == [0, 1]
    assert h.shape == (2, 2)
    validate_head(W, np.zeros(2, np.float32), (2, 2))
    with pytest.raises(UpdateRejected, match="bad_shape"):
        validate_head(W, np.zeros(3, np.float32), (2, 2))
    with pytest.raises(UpdateRejected, match="not_finite"):
        validate_head(np.array([[np.nan, 0], [0, 0]], np.float32), np.zeros(2, np.float32), (2, 2))
    with pytest.raises(UpdateRejected, match="bad_dtype"):
        validate_head(W.astype(np.float64), np.zeros(2, np.float32), (2, 2))


def _binary(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    W = rng.normal(0, 0.5, (5, 1)).astype(np.float32)
    b = rng.normal(0, 0.5, 1).astype(np.float32)
    emb = rng.normal(0, 1, (11, 5)).astype(np.float32)
    y = rng.integers(0, 2, 11).astype(np.int64)
    return W, b, emb, y


def test_logistic_gradient_matches_finite_differences() -> None:
    W, b, emb, y = _binary()
    _, gW, gb = loss_and_grad(W, b, emb, y)  # K = 1: binary cross-entropy
    e64, y64 = emb.astype(np.float64), y.astype(np.float64)

    def loss64(Wx: np.ndarray, bx: np.ndarray) -> float:
        z = (e64 @ Wx + bx)[:, 0]
        p = 1 / (1 + np.exp(-z))
        return float(-np.mean(y64 * np.log(p) + (1 - y64) * np.log(1 - p)))

    eps = 1e-3
    for i in range(W.shape[0]):
        Wp, Wm = W.astype(np.float64), W.astype(np.float64)
        Wp[i, 0] += eps
        Wm[i, 0] -= eps
        assert gW[i, 0] == pytest.approx((loss64(Wp, b) - loss64(Wm, b)) / (2 * eps), abs=2e-4)
    num_b = (loss64(W, b.astype(np.float64) + eps) - loss64(W, b.astype(np.float64) - eps)) / (2 * eps)
    assert gb[0] == pytest.approx(num_b, abs=2e-4)
    assert loss_and_grad(W, b, emb, y)[0] == pytest.approx(loss64(W, b), rel=1e-5)


def test_logistic_value_by_hand_and_no_overflow() -> None:
    # zero weights: p = 0.5 for every sample -> loss ln 2; dL/db = mean(p - y) = 0.5 - 3/4
    W, b = np.zeros((3, 1), np.float32), np.zeros(1, np.float32)
    emb = np.ones((4, 3), np.float32)
    loss, gW, gb = binary_cross_entropy(W, b, emb, np.array([1, 1, 1, 0]))
    assert loss == pytest.approx(np.log(2), rel=1e-6)
    np.testing.assert_allclose(gb, [-0.25], atol=1e-7)
    np.testing.assert_allclose(gW, [[-0.25]] * 3, atol=1e-7)
    # a logit of +-200: softplus form, no inf/nan; the wrong label costs 200 nats
    big = np.full((1, 1), 200.0, np.float32)
    one = np.ones((1, 1), np.float32)
    assert binary_cross_entropy(big, np.zeros(1, np.float32), one, np.array([0]))[0] == pytest.approx(200.0)
    np.testing.assert_allclose(sigmoid(np.array([-200.0, 0.0, 200.0], np.float32)), [0.0, 0.5, 1.0])
    with pytest.raises(ValueError, match="binary_cross_entropy"):
        binary_cross_entropy(
            np.zeros((3, 2), np.float32), np.zeros(2, np.float32), emb, np.zeros(4, np.int64)
        )


def test_logistic_head_predicts_and_scores_both_classes() -> None:
    h = Head(np.array([[2.0]], np.float32), np.array([-1.0], np.float32))
    emb = np.array([[0.0], [1.0], [0.5]], np.float32)  # logits -1, 1, 0
    np.testing.assert_array_equal(h.predict(emb), [0, 1, 0])  # p = 0.5 is not > 0.5
    cls, score = h.scores(emb)
    np.testing.assert_array_equal(cls, [0, 1, 0])
    p1 = 1 / (1 + np.exp(-1.0))
    np.testing.assert_allclose(score, [p1, p1, 0.5], rtol=1e-6)
    np.testing.assert_allclose(activate(h.logits(emb), "logistic")[:, 0], [1 - p1, p1, 0.5], rtol=1e-6)
    soft = Head(np.eye(2, dtype=np.float32), np.zeros(2, np.float32))
    cls2, score2 = soft.scores(np.array([[0.0, np.log(3.0)]], np.float32))
    assert cls2[0] == 1 and score2[0] == pytest.approx(0.75)


def test_logistic_labels_checked_against_k() -> None:
    labels = np.array([-1, 0, 1, 2, 9, 10])
    np.testing.assert_array_equal(check_labels(labels, 1), [False, True, True, False, False, False])
    np.testing.assert_array_equal(check_labels(labels, 10), [False, True, True, True, True, False])
    with pytest.raises(ValueError, match="activation"):
        activate(np.zeros((1, 1), np.float32), "tanh")
