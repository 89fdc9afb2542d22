"""Weighted k-NN (eval.knn): hand-built points whose answer depends on k and the temperature."""

import math

import pytest
import torch

from ssl_vit.eval.knn import knn_predict

# Test point (1, 0); train: one class-0 point on it, two class-1 points at cosine 0.6, one
# class-0 point opposite (cosine -1, never among the 3 nearest).
TRAIN = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.6, -0.8], [-1.0, 0.0]])
LABELS = torch.tensor([0, 1, 1, 0])
TEST = torch.tensor([[1.0, 0.0]])


def test_weighted_vote_hand_computed():
    # T = 0.07: weight exp(1 / 0.07) = e^14.3 for class 0 against 2 e^8.6 for class 1.
    assert math.exp(1 / 0.07) > 2 * math.exp(0.6 / 0.07)
    assert knn_predict(TRAIN, LABELS, TEST, k=3, temperature=0.07).tolist() == [0]
    # T = 10: weights ~ uniform, e^0.1 = 1.11 < 2 e^0.06 = 2.12: the majority, class 1, wins.
    assert math.exp(1 / 10) < 2 * math.exp(0.6 / 10)
    assert knn_predict(TRAIN, LABELS, TEST, k=3, temperature=10.0).tolist() == [1]
    assert knn_predict(TRAIN, LABELS, TEST, k=1, temperature=10.0).tolist() == [0]
    # k above the number of train samples is capped: all 4 vote, 0 wins at T = 0.07.
    assert knn_predict(TRAIN, LABELS, TEST, k=50).tolist() == [0]


def test_cosine_ignores_the_norm():
    scaled = TRAIN * torch.tensor([[5.0], [0.1], [3.0], [7.0]])
    test = torch.tensor([[2.0, 0.0], [-3.0, 0.1], [0.3, 0.4]])
    pred = knn_predict(scaled, LABELS, test, k=1, num_classes=3)
    assert pred.tolist() == [0, 0, 1]  # nearest: (1, 0), (-1, 0), (0.6, 0.8)


def test_chunks_give_the_same_predictions():
    g = torch.Generator().manual_seed(0)
    train, test = torch.randn(50, 8, generator=g), torch.randn(33, 8, generator=g)
    labels = torch.randint(0, 4, (50,), generator=g)
    whole = knn_predict(train, labels, test, k=5)
    assert torch.equal(whole, knn_predict(train, labels, test, k=5, chunk=7))


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k >= 1"):
        knn_predict(TRAIN, LABELS, TEST, k=0)
