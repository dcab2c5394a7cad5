"""The `learned` router: logistic regression over local prompt embeddings, giving P(the strong model is
needed). `sieve router train` fits it on a jsonl of {"prompt": ..., "winner": "weak" | "strong"} and stores
the scores of a reference prompt set, so that a target share of strong calls maps to a threshold
(RouteLLM's calibration) at any time, without refitting."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from sieve.router.embed import make_embedder


@dataclass
class Classifier:
    embedder_spec: str
    weight: torch.Tensor  # [dim]
    bias: float
    reference_scores: list[float]  # sorted scores of the reference prompts
    mean: torch.Tensor  # [dim] the training embeddings' mean and standard deviation: features are standardised
    std: torch.Tensor  # (mean-pooled hidden states all point one way; cosine ~0.8 between unrelated prompts)

    def __post_init__(self):
        self.embedder = make_embedder(self.embedder_spec)
        digest = hashlib.sha256(self.embedder_spec.encode() + self.weight.numpy().tobytes() + str(self.bias).encode())
        self.id = digest.hexdigest()[:16]  # part of the cache key of learned routes: a retrained router is a new key

    def scores(self, prompts: list[str]) -> list[float]:
        x = (self.embedder(prompts) - self.mean) / self.std
        return torch.sigmoid(x @ self.weight + self.bias).tolist()

    def threshold_for_share(self, share: float) -> float:
        """The score threshold that sends `share` of the reference prompts to the strong model
        (strong when score >= threshold)."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"a strong-call share is between 0 and 1, not {share}")
        s = self.reference_scores
        n = len(s)
        k = round(share * n)  # the k highest scores go strong
        if k <= 0:
            return float("inf")
        if k >= n:
            return float("-inf")
        return (s[n - k - 1] + s[n - k]) / 2

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"embedder": self.embedder_spec, "weight": self.weight.tolist(), "bias": self.bias,
                                          "reference_scores": self.reference_scores, "mean": self.mean.tolist(),
                                          "std": self.std.tolist()}))

    @classmethod
    def load(cls, path: str | Path) -> "Classifier":
        try:
            d = json.loads(Path(path).read_text())
            return cls(d["embedder"], torch.tensor(d["weight"], dtype=torch.float32), float(d["bias"]),
                       sorted(float(x) for x in d["reference_scores"]), torch.tensor(d["mean"], dtype=torch.float32),
                       torch.tensor(d["std"], dtype=torch.float32))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a router classifier written by `sieve router train`: {e}") from None


def read_examples(path: str | Path) -> tuple[list[str], list[int]]:
    prompts, labels = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            prompt, winner = d["prompt"], d["winner"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{n}: expected {{\"prompt\": ..., \"winner\": \"weak\" | \"strong\"}}") from None
        if winner not in ("weak", "strong") or not isinstance(prompt, str):
            raise ValueError(f"{path}:{n}: `winner` is \"weak\" or \"strong\" and `prompt` a string")
        prompts.append(prompt)
        labels.append(int(winner == "strong"))
    if len(set(labels)) < 2:
        raise ValueError(f"{path}: training needs examples of both winners")
    return prompts, labels


def fit(prompts: list[str], labels: list[int], embedder_spec: str = "hash:4096", reference: list[str] | None = None,
        l2: float = 1e-3, steps: int = 200, folds: int = 5) -> Classifier:
    """Class-balanced logistic regression (L-BFGS, L2), deterministic for the same data. Without a reference
    set, the calibration scores are the training prompts' out-of-fold scores (`folds`-fold): a model's
    scores on its own training prompts are more extreme than on new ones, and would skew every share."""
    embedder = make_embedder(embedder_spec)
    raw = embedder(prompts)
    mean, std = raw.mean(0), raw.std(0).clamp_min(1e-6)
    x = (raw - mean) / std
    y = torch.tensor(labels, dtype=torch.float32)
    w, b = _fit(x, y, l2, steps)
    if reference:
        scores = torch.sigmoid((embedder(reference) - mean) / std @ w + b).tolist()
    else:
        scores = []
        for k in range(folds):
            held = torch.arange(len(prompts)) % folds == k
            if held.all() or not held.any() or len(set(y[~held].tolist())) < 2:
                continue
            wk, bk = _fit(x[~held], y[~held], l2, steps)
            scores += torch.sigmoid(x[held] @ wk + bk).tolist()
    return Classifier(embedder_spec, w, b, sorted(scores), mean, std)


def _fit(x: torch.Tensor, y: torch.Tensor, l2: float, steps: int) -> tuple[torch.Tensor, float]:
    pos = y.mean().clamp(1e-3, 1 - 1e-3)
    sample_w = torch.where(y > 0, 0.5 / pos, 0.5 / (1 - pos))
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y, weight=sample_w)
                + l2 * w.square().sum())
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().clone(), float(b.detach())
