"""Sampling: what a request asks for and how its tokens are drawn.

    params.py              SamplingParams, per request (mirrors the gRPC message; loads without torch)
    structured.py          StructuredOutput, the grammar an output must match (part of SamplingParams)
    grammar.py             structured outputs: specs compiled with llguidance, a matcher per sequence, logits masks
    sampler.py             the fixed-order sampler and logprobs, seeded per position
    generation_config.py   the model's generation_config.json: extra EOS ids and sampling defaults
"""
