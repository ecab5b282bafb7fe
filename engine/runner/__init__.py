"""Running a scheduled batch through the model.

    model_runner.py    ModelRunner: one model call per step, the logits of the sequences due a token
    layer_hook.py      the per-layer hook: which blocks each layer has made final (layer-wise KV sends)
    decode_graphs.py   pure-decode steps as CUDA graphs, one per padded batch size
"""
