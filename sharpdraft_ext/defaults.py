"""The SharpDraft scaling's default parameters, in one place (spec §1; the paper's setting).

Every default of the kernel's Python API (`sharp_attention`, `sharp_attention_varlen`,
`query_scale`, `reference`), of `sharpdraft.SharpConfig`, of the drafters and of the vLLM plugin
is one of these; csrc/attention/sharp_params.h's `SharpParams` field defaults mirror them
(tests/test_settings.py checks the header). A drafter normally overrides N_REF with its own
training context (`config.train_context`).
"""
DEFAULT_SLOPE = 0.2        # lambda in beta(n) = 1 + lambda ln(n / n_ref)
DEFAULT_N_REF = 2048       # the reference cardinality n_ref
DEFAULT_TOPK = 32          # k of the exact top-k correction
DEFAULT_CONTRAST = 5.0     # Delta of the exact top-k correction
