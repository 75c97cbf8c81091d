"""Boosted trees served as numpy arrays (bot/trees.py) give scikit-learn's own logits."""

from __future__ import annotations

import numpy as np
import pytest

from bot.trees import Trees, fit_trees


def test_the_arrays_give_scikit_learns_logits_for_every_row(tmp_path):
    from sklearn.ensemble import HistGradientBoostingClassifier

    from bot.trees import LEARNING_RATE, MAX_ITER, MAX_LEAF_NODES
    rng = np.random.RandomState(3)
    x = rng.randn(2000, 12).astype(np.float32)
    y = (x[:, 0] * x[:, 1] + np.sin(3 * x[:, 2]) + 0.3 * rng.randn(2000) > 0).astype(int)
    trees = fit_trees(x, y, seed=5)
    model = HistGradientBoostingClassifier(max_iter=MAX_ITER, learning_rate=LEARNING_RATE,
                                           max_leaf_nodes=MAX_LEAF_NODES, random_state=5).fit(x, y)
    test = rng.randn(500, 12).astype(np.float32)
    np.testing.assert_allclose(trees.logits(test), model.decision_function(test), rtol=1e-4, atol=1e-4)
    assert trees.logits(test[0]).shape == (1,) and trees.logits(test[0])[0] == pytest.approx(trees.logits(test)[0])
    np.savez(tmp_path / "t.npz", **trees.arrays())
    again = Trees.from_arrays(np.load(tmp_path / "t.npz"))
    np.testing.assert_array_equal(again.logits(test), trees.logits(test))


def test_features_must_be_finite():
    x = np.zeros((10, 2), dtype=np.float32)
    x[3, 1] = np.nan
    with pytest.raises(ValueError, match="finite"):
        fit_trees(x, np.arange(10) % 2)
