"""Measurements: the speed / acceptance benchmark (`bench`) and the analyses of attention-mass
dilution (`sharpdraft analyze ...`).

- `bench`: tau, tokens/s and speedup over target-only decoding, frozen and SharpDraft;
- `mass`: top-k attention mass and locality of every drafter layer (and the target's) against
  the number of visible keys, under many scalings, from the q / k the kernel sees
  (`attention.observe`); `calibrate`: per-layer slopes from it;
- `sweep`: teacher-forced acceptance proxy by context bucket; `long_decode`: tau by output
  length in real decoding; `adapt`: SharpDraft against online fine-tuning;
- `report`: the one writer of their reports (name.json / name.md / name.png, atomically;
  matplotlib imported only when a figure is made).

Layer: the top of the library (below only `integrations` and `cli`).
"""
