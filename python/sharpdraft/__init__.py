"""sharpdraft: speculative decoding with drafters whose attention runs on sharpdraft_ext."""
