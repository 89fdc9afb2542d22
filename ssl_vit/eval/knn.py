"""Weighted k-nearest-neighbour classification of frozen features (a pretraining monitor).

As DINO's `knn_classifier` (Caron et al. 2021, section 4.1; solo-learn's `WeightedKNNClassifier`
does the same): features are L2-normalized, the k train samples of highest cosine similarity
vote for their class with weight exp(similarity / temperature), the class of largest total
weight wins (ties: the lowest class index).

Shape legend: N train samples, M test samples, D feature width, K classes, k neighbours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssl_vit.errors import ConfigError

__all__ = ["knn_predict"]


@torch.no_grad()
def knn_predict(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    k: int = 20,
    temperature: float = 0.07,
    num_classes: int | None = None,
    chunk: int = 1024,
) -> torch.Tensor:
    """Predicted classes [M] of test features [M, D] from train features [N, D] and labels
    [N]; `k` is capped at N, `chunk` test rows are compared at a time (memory chunk x N)."""
    if k < 1 or temperature <= 0:
        raise ConfigError(f"k-NN: need k >= 1 and temperature > 0, got k={k}, T={temperature}")
    train_ND = F.normalize(train_x.float(), dim=1)
    train_N = train_y.to(train_ND.device, torch.int64).reshape(-1)
    K = int(train_N.max()) + 1 if num_classes is None else num_classes
    k = min(k, train_ND.shape[0])
    preds = []
    for test_CD in F.normalize(test_x.float(), dim=1).to(train_ND.device).split(chunk):
        sim_Ck, idx_Ck = (test_CD @ train_ND.T).topk(k, dim=1)
        votes_CK = torch.zeros(test_CD.shape[0], K, device=train_ND.device)
        votes_CK.scatter_add_(1, train_N[idx_Ck], (sim_Ck / temperature).exp())
        preds.append(votes_CK.argmax(dim=1))
    return torch.cat(preds)
