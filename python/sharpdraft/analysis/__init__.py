"""Analyses of attention-mass dilution (`sharpdraft analyze ...`, issue 13).

- `mass`: top-k attention mass and locality (where the mass goes) of every drafter layer, and of
  the target's layers for reference, against the number of visible keys, under many scalings,
  from the q / k the kernel sees (`attention.observe`).
"""
