"""Gradient-boosted trees for a binary decision, trained with scikit-learn, served as numpy arrays.

scikit-learn's ``HistGradientBoostingClassifier`` scores one row in about 2 ms (its thread pool
and input checks); a message has a budget of about a millisecond of CPU in all. So the fitted
trees are copied into flat arrays (:class:`Trees`) and walked for all trees at once, one level
per step: tens of microseconds a row, the same logits (tests/test_trees.py compares them with
``decision_function``). The copy reads the fitted model's ``_predictors`` and
``_baseline_prediction``, which scikit-learn does not document; the test fails if they change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Trees:
    """Boosted regression trees over float32[F] rows, one output (the logit of class 1), as one node
    table: T trees, M nodes in all.

    Attributes:
        feature: int32[M]; threshold: float32[M] (a row goes left when ``x[feature] <= threshold``);
        children: int32[M, 2], the left and right child nodes (a leaf is its own child, with threshold +inf);
        value: float32[M] (leaves; 0 elsewhere); roots: int32[T]; depth: int32[1], the deepest
        leaf's depth (so many steps reach every leaf); baseline: float32[1], the logit before any tree.
    """

    feature: np.ndarray
    threshold: np.ndarray
    children: np.ndarray
    value: np.ndarray
    roots: np.ndarray
    depth: np.ndarray
    baseline: np.ndarray

    def logits(self, x: np.ndarray) -> np.ndarray:
        """float32[R] for rows x float32[R, F], or float32[1] for one row float32[F] (about 0.1 ms:
        one step of every tree at once per level)."""
        if x.ndim == 1:
            node = self.roots
            for _ in range(int(self.depth[0])):
                node = self.children[node, (x[self.feature[node]] > self.threshold[node]).view(np.int8)]
            return np.asarray([self.baseline[0] + self.value[node].sum()], dtype=np.float32)
        node = np.broadcast_to(self.roots, (x.shape[0], self.roots.shape[0]))
        r = np.arange(x.shape[0])[:, None]
        for _ in range(int(self.depth[0])):
            node = self.children[node, (x[r, self.feature[node]] > self.threshold[node]).view(np.int8)]
        return (self.baseline[0] + self.value[node].sum(axis=1)).astype(np.float32)

    def arrays(self) -> dict[str, np.ndarray]:
        return {f"trees_{k}": getattr(self, k) for k in _FIELDS}

    @classmethod
    def from_arrays(cls, saved) -> "Trees":
        """From :meth:`arrays` as saved (a mapping such as ``np.load``'s)."""
        return cls(*(saved[f"trees_{k}"] for k in _FIELDS))


_FIELDS = ("feature", "threshold", "children", "value", "roots", "depth", "baseline")


#: Boosting rounds at most, learning rate and leaves per tree (scikit-learn's early stopping on a
#: 10 % split picks the rounds); chosen on the topic-fit verifier's held-out pairs (bot/topic_fit.py).
MAX_ITER, LEARNING_RATE, MAX_LEAF_NODES = 400, 0.08, 31


def fit_trees(x: np.ndarray, y: np.ndarray, seed: int = 0) -> Trees:
    """Fit on x float32[N, F] (finite), y int[N] in {0, 1}; deterministic for a given ``seed``.

    Raises:
        ValueError: non-finite features, or not two classes.
    """
    from sklearn.ensemble import HistGradientBoostingClassifier  # training only

    if not np.isfinite(x).all():
        raise ValueError("fit_trees: features must be finite")
    model = HistGradientBoostingClassifier(max_iter=MAX_ITER, learning_rate=LEARNING_RATE,
                                           max_leaf_nodes=MAX_LEAF_NODES, random_state=seed).fit(x, y)
    nodes = [p[0].nodes for p in model._predictors]
    starts = np.cumsum([0] + [len(n) for n in nodes[:-1]])
    table = np.concatenate(nodes)
    own = np.arange(len(table), dtype=np.int32)
    offset = np.repeat(starts, [len(n) for n in nodes]).astype(np.int32)
    leaf = table["is_leaf"].astype(bool)
    return Trees(feature=np.where(leaf, 0, table["feature_idx"]).astype(np.int32),
                 threshold=np.where(leaf, np.inf, table["num_threshold"]).astype(np.float32),
                 children=np.stack([np.where(leaf, own, table["left"] + offset),
                                    np.where(leaf, own, table["right"] + offset)], axis=1).astype(np.int32),
                 value=np.where(leaf, table["value"], 0.0).astype(np.float32), roots=starts.astype(np.int32),
                 depth=np.asarray([int(table["depth"].max())], dtype=np.int32),
                 baseline=np.asarray(model._baseline_prediction, dtype=np.float32).reshape(1))
