"""Sampling: what a request asks for and how its tokens are drawn.

    params.py              SamplingParams, per request (mirrors the gRPC message; loads without torch)
    sampler.py             the fixed-order sampler and logprobs, seeded per position
    generation_config.py   the model's generation_config.json: extra EOS ids and sampling defaults
"""
