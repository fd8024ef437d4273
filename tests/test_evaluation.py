import pytest
import torch

from hf_contrast import knn_top1


def naive_knn(train_f, train_l, test_f, k, t, num_classes):
    train_f = torch.nn.functional.normalize(train_f, dim=1)
    test_f = torch.nn.functional.normalize(test_f, dim=1)
    preds = []
    for x in test_f:
        sims = [(float(x @ y), int(label)) for y, label in zip(train_f, train_l, strict=False)]
        sims.sort(key=lambda s: -s[0])
        votes = [0.0] * num_classes
        for s, label in sims[:k]:
            votes[label] += float(torch.exp(torch.tensor(s / t)))
        preds.append(max(range(num_classes), key=lambda c: votes[c]))
    return torch.tensor(preds)


def test_knn_matches_naive_vote():
    g = torch.Generator().manual_seed(0)
    train_f, test_f = torch.randn(60, 5, generator=g), torch.randn(20, 5, generator=g)
    train_l, test_l = torch.randint(0, 3, (60,), generator=g), torch.randint(0, 3, (20,), generator=g)
    preds = naive_knn(train_f, train_l, test_f, k=7, t=0.1, num_classes=3)
    expected = (preds == test_l).float().mean().item()
    got = knn_top1(train_f, train_l, test_f, test_l, k=7, temperature=0.1, chunk_size=6)
    assert got == pytest.approx(expected, abs=1e-6)  # one flipped prediction moves it by 0.05


def test_knn_separable_clusters_score_one_and_shuffled_labels_score_low():
    g = torch.Generator().manual_seed(1)
    centers = torch.eye(4) * 10
    train_l = torch.arange(4).repeat(25)
    test_l = torch.arange(4).repeat(10)
    train_f = centers[train_l] + torch.randn(100, 4, generator=g)
    test_f = centers[test_l] + torch.randn(40, 4, generator=g)
    assert knn_top1(train_f, train_l, test_f, test_l, k=10) == 1.0
    assert knn_top1(train_f, train_l[torch.randperm(100, generator=g)], test_f, test_l, k=10) < 0.6
