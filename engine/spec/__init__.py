"""Speculative decoding (``speculative:``); nothing here yet.

What goes here: proposers (n-gram over the request's own tokens, a draft model), the verification of
1 + k tokens per sequence inside the engine's batched step (greedy: identical output to no speculation;
sampling: the rejection rule), the rollback of rejected tokens' KV through the block manager, and the
per-step decision to turn speculation down when it would lose.
"""
