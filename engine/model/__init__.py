"""The model and its layers: the Llama-family decoder and what it is built from.

    config.py               ModelConfig, read from a Hugging Face config.json
    model.py                LlamaModel (RMSNorm, RoPE, GQA, SwiGLU, sliding window) over the paged KV cache
    linear.py               Linear: the projections and their weight layouts
    attention.py            paged attention (eager: gather + bmm; prefill through SDPA) and its metadata
    attention_compiled.py   decode attention through the block table, compiled by Inductor
    attention_flex.py       prefill and decode attention through flex_attention over the paged cache
    rope.py                 rotary position embeddings and their scalings
    kernel_choice.py        per-machine kernel and weight-layout choices, measured and cached on disk
    loader.py               loading a model directory (safetensors) and its fingerprint
    presets.py              the embedded models: the trained `pydoc` and random-weight presets

Modules are imported by their own names; this package imports none of them (`config` loads without torch).
"""
