"""sharpdraft: speculative decoding whose drafters attend through a fused kernel with
SharpDraft's cardinality-aware query scaling (beta(n_i) = 1 + slope * ln(n_i / n_ref)).

The public API:

    import sharpdraft
    target, tokenizer, info = sharpdraft.load_target()          # SmolLM2-135M-Instruct, offline
    drafter = sharpdraft.load_drafter("eagle3", target)         # shipped checkpoint, SharpDraft on
    out = sharpdraft.generate(target, drafter, "Write a story.", tokenizer=tokenizer)
    print(tokenizer.decode(out.tokens), out.tau)

`SharpConfig` describes the scaling; the kernel itself is `sharpdraft_ext.sharp_attention`;
`patch_attention(model, SharpConfig(...))` routes a Hugging Face-style model's attention
through it.
"""
from importlib.metadata import PackageNotFoundError, version as _version

from .attention import SharpConfig, patch_attention
from .drafters import load_drafter
from .inference import GenerationResult, generate
from .target import load_target

try:
    __version__ = _version("sharpdraft")
except PackageNotFoundError:        # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["GenerationResult", "SharpConfig", "__version__", "generate", "load_drafter",
           "load_target", "patch_attention"]
