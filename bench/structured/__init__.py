"""Structured-output benchmark: grammar libraries' token-mask cost (`python -m bench.structured.mask_bench`).

    libraries.py   one adapter per grammar library (xgrammar, llguidance, outlines-core): set up, compile,
                   fill a batch's bitmask, advance; plus the feature probes the table reports
    vocab.py       the tokenizers measured: the committed 4096-token one, the `small` preset's, and a
                   synthetic ~150k-token byte-level BPE built here (no downloads)
    mask_bench.py  the run: per library x vocabulary, compile time and the per-step mask time at batch 1
                   and 32, beside the machine's matmul / memcpy limits and a batch-32 decode step of `small`
"""
