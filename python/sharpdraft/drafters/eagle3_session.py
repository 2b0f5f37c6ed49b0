"""The EAGLE-3 drafter's inference session (`Eagle3Drafter.start`): chain drafting, tree drafting
(EAGLE-2's dynamic tree) and commits, through `Eagle3Drafter.draft_step` (the fused CPU step or
the modules); the protocol it follows is `drafters.protocol`."""
from __future__ import annotations

from typing import TYPE_CHECKING, List

import torch
from transformers import DynamicCache

from .layers import window_mask
from .sessions import crop_to, no_drafts, state_bytes, wanted
from .trees import DraftTree, expand_frontier

if TYPE_CHECKING:
    from .eagle3 import Eagle3Drafter


class Eagle3Session:
    """Drafting state: committed tokens, the drafter KV cache of rows 0 .. c - 1, and the target
    features of the committed positions not yet run through the drafter."""

    def __init__(self, drafter: Eagle3Drafter, target, tokens: List[int],
                 features: torch.Tensor, cache=None):
        self.drafter, self.target = drafter, target
        self.tokens = list(tokens)             # committed, without the pending `last`
        self.pending = features                 # (1, P - c, n * Ht) for positions c .. P - 1
        self.cache = DynamicCache() if cache is None else cache   # `session_cache`
        self.last = None
        self.emb = drafter.token_embeddings(target)

    @torch.no_grad()
    def absorb_prompt(self) -> None:
        """Store the keys and values of the prompt's rows now, all but the last (row i pairs
        feature g_i with token i + 1, known for i < P - 1; row P - 1 waits for the first new
        token). Only the last row's output is ever read, so these rows need no attention and no
        MLP (`write_keys`), and the work happens with the target's prefill, as a serving engine
        does it, instead of inside the first draft step."""
        c, end = self.cache.get_seq_length(), len(self.tokens) - 1
        if end <= c:
            return
        dev = self.pending.device
        ids = torch.tensor([self.tokens[c + 1:end + 1]], device=dev)
        pos = torch.arange(c, end, device=dev)[None]
        self.drafter.write_keys(self.emb(ids), self.drafter.fuse(self.pending[:, :end - c]), pos,
                                self.cache)
        self.pending = self.pending[:, end - c:]

    def _check(self, position: int) -> None:
        if position != len(self.tokens):
            raise ValueError(f"EAGLE-3 session: position {position} != committed length "
                             f"{len(self.tokens)}")

    def _root(self, last: int, position: int):
        """Run the pending rows (the last one pairs g_{P-1} with `last`); returns row P - 1's
        draft logits (draft vocab,) and next hidden input (1, 1, H)."""
        self._check(position)
        c = self.cache.get_seq_length()
        dev = self.pending.device
        ids = torch.tensor([self.tokens[c + 1:position] + [last]], device=dev)
        pos = torch.arange(c, position, device=dev)[None]
        # rows c .. P - 1 are context rows: each sees a sliding window of W keys before it (the
        # prefill's last row too), not the W cached keys plus every row of the call
        mask = window_mask(pos[0], position, self.drafter.context_window,
                           self.drafter.attention_sinks)
        logits, hidden = self.drafter.draft_step(self.target, self.emb(ids),
                                                 self.drafter.fuse(self.pending), pos,
                                                 self.cache, mask)
        self.pending = self.pending[:, :0]
        self.last = last
        return logits[0, -1], hidden[:, -1:]

    @torch.no_grad()
    def propose(self, last: int, position: int, draw, stop_below: float = 0.0,
                max_drafts=None) -> tuple:
        """Chain drafting: `chain_length` drafts (at most max_drafts), each fed back as the next
        row's token; with stop_below > 0, none after the first whose probability under
        softmax(row) is below it (`Drafter.drafts_one_by_one`). max_drafts=0 drafts nothing:
        the pending rows wait for the next propose."""
        d = self.drafter
        n = wanted(d.config.chain_length, max_drafts)
        if n == 0:
            self._check(position)
            self.last = last
            return no_drafts(self.target)
        draft_logits, hidden = self._root(last, position)
        drafts, logits = [], []
        for j in range(n):
            row = d.to_target_vocab(self.target, draft_logits[None])[0]
            logits.append(row)
            drafts.append(draw(row))
            unsure = (stop_below > 0
                      and float(torch.softmax(row.float(), -1)[drafts[-1]]) < stop_below)
            if j + 1 == n or unsure:
                break
            pos = torch.tensor([[position + j]], device=hidden.device)
            step_logits, hidden = d.draft_step(
                self.target, self.emb(torch.tensor([[drafts[-1]]], device=hidden.device)),
                hidden, pos, self.cache)
            draft_logits = step_logits[0, 0]
        crop_to(self.cache, position)         # keep the rows of committed positions only
        return drafts, torch.stack(logits)

    @torch.no_grad()
    def propose_tree(self, last: int, position: int) -> DraftTree:
        """Tree drafting (EAGLE-2's dynamic tree): at each depth the `tree_topk` best nodes of
        the newest depth by path log-probability are expanded, each with its `tree_topk` most
        likely children, and every child joins the candidate pool (`expand_frontier`); finally
        the `tree_tokens` best candidates of the pool (an ancestor-closed set) form the tree.
        Only expanded nodes cost a drafter forward: the pool's other candidates are free."""
        d = self.drafter
        cfg = d.config
        dev = self.pending.device
        root_logits, hidden = self._root(last, position)
        logp = torch.log_softmax(root_logits, dim=-1)
        top = logp.topk(cfg.tree_topk)
        to_target = (lambda i: int(d.d2t[i])) if d.d2t is not None else int
        # candidate nodes: target token, path log-probability, parent, depth
        tokens = [to_target(i) for i in top.indices.tolist()]
        scores = top.values.tolist()
        parents = [-1] * len(tokens)
        depths = [1] * len(tokens)
        frontier = list(range(len(tokens)))
        frontier_hidden = hidden.expand(1, len(frontier), -1)
        rows = {}                                # candidate -> drafter cache row
        for depth in range(1, cfg.tree_depth):
            c = self.cache.get_seq_length()
            for n, i in enumerate(frontier):
                rows[i] = c + n
            vis = torch.zeros(len(frontier), c + len(frontier), dtype=torch.bool, device=dev)
            vis[:, :position] = True
            for n, i in enumerate(frontier):
                j = i
                while j >= 0:
                    if j in rows:
                        vis[n, rows[j]] = True
                    j = parents[j]
            ids = torch.tensor([[tokens[i] for i in frontier]], device=dev)
            pos = torch.full((1, len(frontier)), position + depth - 1, device=dev)
            step_logits, hid = d.draft_step(self.target, self.emb(ids), frontier_hidden, pos,
                                            self.cache, attn_mask=vis[None, None])
            logp = torch.log_softmax(step_logits[0], dim=-1)                   # (F, V)
            base = torch.tensor([scores[i] for i in frontier], device=dev)
            kid_tok, kid_score, kid_row, nxt = expand_frontier(base, logp, cfg.tree_topk)
            first = len(tokens)
            for tok, score, f in zip(kid_tok.tolist(), kid_score.tolist(), kid_row.tolist()):
                tokens.append(to_target(tok))
                scores.append(score)
                parents.append(frontier[f])
                depths.append(depth + 1)
            frontier = [first + j for j in nxt.tolist()]
            frontier_hidden = hid[:, kid_row[nxt]]   # a child's hidden input: its parent's output
        crop_to(self.cache, position)
        # keep the best `tree_tokens` nodes: a child's score is its parent's plus a log-prob
        # <= 0 and ties go to the shallower, earlier node, so a parent always ranks before its
        # children and the chosen set is closed under ancestors
        order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))
        chosen = sorted(order[:cfg.tree_tokens])
        remap = {old: new for new, old in enumerate(chosen)}
        return DraftTree([tokens[i] for i in chosen],
                         [remap[parents[i]] if parents[i] >= 0 else -1 for i in chosen],
                         [depths[i] for i in chosen])

    def commit(self, accepted: List[int], hidden_states) -> None:
        """`hidden_states`: target hidden states whose rows 0 .. len(accepted) - 1 are the
        committed positions P .. P + len(accepted) - 1 ([last] + accepted drafts)."""
        feats = self.drafter.context_features(hidden_states)[:, :len(accepted)]
        self.pending = torch.cat([self.pending, feats], dim=1)
        self.tokens.append(self.last)
        self.tokens.extend(accepted[:-1])

    def state_bytes(self) -> int:
        return state_bytes(self.cache, self.pending)
