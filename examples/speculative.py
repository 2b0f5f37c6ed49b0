"""Speculative decoding through the public API: the default target (SmolLM2-135M-Instruct,
offline), each shipped drafter with SharpDraft attention, and target-only decoding to compare.

    python examples/speculative.py [--max-new-tokens 64]

Greedy decoding is lossless: every drafter's output equals the target-only output, which the
script checks.
"""
import argparse

import sharpdraft

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    target, tokenizer, info = sharpdraft.load_target()
    print(f"sharpdraft {sharpdraft.__version__}; target {info.get('source', 'default')}")
    ref = sharpdraft.generate(target, None, PROMPT, tokenizer=tokenizer,
                              max_new_tokens=args.max_new_tokens)
    print(tokenizer.decode(ref.tokens, skip_special_tokens=True))
    print(f"{'target only':>14}: {ref.decode_tokens_per_s:6.1f} decode tok/s")
    for kind, tree in (("dflash", False), ("eagle3", False), ("eagle3", True), ("pard", False),
                       ("longspark", False)):
        drafter = sharpdraft.load_drafter(kind, target, tokenizer=tokenizer)  # SharpDraft on
        out = sharpdraft.generate(target, drafter, PROMPT, tokenizer=tokenizer, tree=tree,
                                  max_new_tokens=args.max_new_tokens)
        name = kind + ("-tree" if tree else "")
        print(f"{name:>14}: tau {out.tau:.2f}, {out.decode_tokens_per_s:6.1f} decode tok/s, "
              f"identical to target-only: {out.tokens == ref.tokens}")


if __name__ == "__main__":
    main()
