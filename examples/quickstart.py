"""Quickstart: what cardinality-aware query scaling does to attention on a growing context.

A query row sees n keys: k = 32 "right" keys with logit Delta = 5 and n - k others with logit 0
(the two-level model of spec §1). Plain attention's top-k mass falls as n grows; sharp attention
multiplies the query by beta(n) and keeps it near its value at the reference cardinality n_ref.
The top-k mass is read off the kernel's log-sum-exp: exp(lse over the top-k keys - lse over all),
with n_visible pinning beta to the full row's cardinality in the top-k-only call.

    python examples/quickstart.py
"""
import math

import torch

import sharpdraft_ext as ext

D, TOPK, DELTA, N_REF = 64, 32, 5.0, 2048


def row(n: int):
    """q (1, 1, 1, D) and keys (1, 1, n, D) whose scaled logits are DELTA (first TOPK) and 0."""
    g = torch.Generator().manual_seed(n)
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = math.sqrt(D)  # scale = 1/sqrt(D): logit = k[..., 0]
    k = torch.randn(1, 1, n, D, generator=g)
    k[..., 0] = 0.0
    k[..., :TOPK, 0] = DELTA
    v = torch.randn(1, 1, n, D, generator=g)
    return q, k, v


def topk_mass(q, k, v, **kw) -> float:
    n = k.shape[2]
    _, lse_all = ext.sharp_attention(q, k, v, return_lse=True, **kw)
    _, lse_top = ext.sharp_attention(q, k[:, :, :TOPK], v[:, :, :TOPK], n_visible=n,
                                     return_lse=True, **kw)
    return math.exp(lse_top.item() - lse_all.item())


def main():
    print(f"sharpdraft_ext CPU kernel: {ext.cpu_isa()}; n_ref = {N_REF}, k = {TOPK}, "
          f"Delta = {DELTA}, slope = 1/Delta = {1 / DELTA}")
    print(f"{'n keys':>8} {'beta fixed':>11} {'mass none':>10} {'mass fixed':>11} "
          f"{'mass exact':>11}")
    for n in (512, 2048, 8192, 32768, 131072):
        q, k, v = row(n)
        beta = ext.query_scale(torch.tensor([n]), mode="fixed_slope", slope=1 / DELTA,
                               n_ref=N_REF).item()
        m_none = topk_mass(q, k, v, mode="none")
        m_fixed = topk_mass(q, k, v, mode="fixed_slope", slope=1 / DELTA, n_ref=N_REF)
        m_exact = topk_mass(q, k, v, mode="exact_topk", topk=TOPK, contrast=DELTA, n_ref=N_REF)
        print(f"{n:>8} {beta:>11.4f} {m_none:>10.4f} {m_fixed:>11.4f} {m_exact:>11.4f}")
    print("Below n_ref beta stays 1 (beta_min = 1: a short context is never softened); above it "
          "the exact\ncorrection holds the top-k mass at its n_ref value and the fixed slope "
          "stays close to it.")


if __name__ == "__main__":
    main()
