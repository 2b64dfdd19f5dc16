"""Seeded random preference pairs for the pair losses' unit tests (DPO, reward model)."""

from __future__ import annotations

import torch


def random_pairs(n: int, seed: int = 0) -> list[dict]:
    """n pairs {"chosen": (ids, mask), "rejected": (ids, mask)} with a shared prompt of 2-6 tokens
    (mask 0) and completions of 1-5 tokens (mask 1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(2, 7, (1,), generator=g))
        prompt = torch.randint(3, 50, (p,), generator=g).tolist()
        sides = []
        for _ in range(2):
            c = int(torch.randint(1, 6, (1,), generator=g))
            sides.append((prompt + torch.randint(3, 50, (c,), generator=g).tolist(), [0] * p + [1] * c))
        out.append({"chosen": sides[0], "rejected": sides[1]})
    return out
