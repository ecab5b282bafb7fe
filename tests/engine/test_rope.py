"""RoPE scalings, YaRN above all: frequencies and attention factor equal transformers' own
(`ROPE_INIT_FUNCTIONS["yarn"]`); Llama, Qwen2 and Qwen3 checkpoints with yarn scaling give transformers'
logits at every position and its greedy tokens, running well past `original_max_position_embeddings`, on
every attention path and over two tensor-parallel ranks; a scaling or yarn key the engine does not apply
is refused naming the key.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from hf_checkpoints import hf_greedy, hf_logits, hf_model, random_prompt, write_checkpoint
from tp_support import Follower

from engine import Engine, EngineArgs, SamplingParams
from engine.model.config import ModelConfig
from engine.model.rope import RotaryEmbedding, attention_factor, inv_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

VOCAB = 1024          # the tiny preset's tokenizer
ATOL = 1e-4           # as tests/engine/test_hf_equivalence.py
OLD_LEN = 16          # original_max_position_embeddings of the checkpoints: prompts and generation run past it

SMALL = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512)


def _yarn(**params) -> dict:
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": OLD_LEN, **params}


# -- frequencies and attention factor ------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type, changes, partial", [
    ("qwen2", {"rope_theta": 1e6, "rope_scaling": _yarn()}, 1.0),                                  # Qwen2.5's form
    ("llama", {"rope_scaling": {"type": "yarn", "factor": 8, "original_max_position_embeddings": 64}}, 1.0),
    ("llama", {"rope_parameters": {**_yarn(factor=32.0, original_max_position_embeddings=4096, truncate=False,
                                          beta_fast=32.0, beta_slow=1.0), "rope_theta": 150000.0}}, 1.0),
    ("llama", {"rope_scaling": _yarn(factor=40.0, mscale=0.707, mscale_all_dim=1.0)}, 1.0),
    ("llama", {"rope_scaling": _yarn(mscale=1.0, mscale_all_dim=1.0)}, 1.0),                      # ratio 1
    ("qwen3", {"rope_scaling": _yarn(attention_factor=0.8, beta_fast=8, beta_slow=2)}, 1.0),
    ("llama", {"rope_scaling": _yarn(original_max_position_embeddings=4)}, 1.0),     # both bounds at 0: a step
    ("llama", {"rope_scaling": _yarn(factor=0.5)}, 1.0),                              # shrinking: factor 1
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, 1.0),           # old length: max positions
    ("llama", {"rope_scaling": _yarn(), "original_max_position_embeddings": 64}, 1.0),   # top level comes first
    ("llama", {"rope_scaling": _yarn(truncate=False)}, 0.5),                          # a partial rotary factor
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0}}, 1.0),                      # llama3: same old length
])
def test_frequencies_and_attention_factor_equal_transformers(model_type, changes, partial):
    raw = {"model_type": model_type, **SMALL, **changes}
    ours = dataclasses.replace(ModelConfig.from_dict(raw), partial_rotary_factor=partial)
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    theirs = transformers.AutoConfig.for_model(model_type, **kwargs, partial_rotary_factor=partial)
    kind = theirs.rope_parameters["rope_type"]
    inv, factor = ROPE_INIT_FUNCTIONS[kind](theirs, torch.device("cpu"))
    assert inv.shape == (ours.rotary_dim // 2,)
    torch.testing.assert_close(inv_frequencies(ours), inv, rtol=1e-6, atol=0)
    assert attention_factor(ours) == pytest.approx(factor, rel=1e-12)


def test_the_attention_factor_scales_the_rotated_dims_only():
    """cos and sin carry the factor (q·k by its square); dims past a partial rotary_dim pass through."""
    cfg = ModelConfig.from_dict({"model_type": "llama", **SMALL, "rope_scaling": _yarn(factor=16.0)})
    cfg = dataclasses.replace(cfg, partial_rotary_factor=0.5)
    rope = RotaryEmbedding(cfg, 64, torch.device("cpu"), torch.float32)
    scale = attention_factor(cfg)
    assert scale == pytest.approx(0.1 * torch.tensor(16.0).log().item() + 1)
    freqs = torch.outer(torch.arange(64).float(), inv_frequencies(cfg))
    angles = torch.cat((freqs, freqs), dim=-1)
    r = cfg.rotary_dim
    torch.testing.assert_close(rope.cos[:, :r], angles.cos() * scale)
    torch.testing.assert_close(rope.sin[:, :r], angles.sin() * scale)
    assert (rope.cos[:, r:] == 1).all() and (rope.sin[:, r:] == 0).all()
    q = torch.randn(64, 4, cfg.head_dim)
    rotated, _ = rope.apply(q, q[:, :2], torch.arange(64))
    assert torch.equal(rotated[..., r:], q[..., r:])


# -- checkpoints --------------------------------------------------------------------------------------------------

def _configs() -> dict:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, pad_token_id=None, rms_norm_eps=1e-6)
    return {
        "llama": transformers.LlamaConfig(**common, rope_parameters={**_yarn(), "rope_theta": 10000.0}),
        "llama_mscale": transformers.LlamaConfig(**common, rope_parameters={
            **_yarn(factor=8.0, mscale=1.0, mscale_all_dim=0.5, truncate=False), "rope_theta": 10000.0}),
        "qwen2": transformers.Qwen2Config(**common, use_sliding_window=False, sliding_window=None,
                                          rope_parameters={**_yarn(), "rope_theta": 1_000_000.0}),
        "qwen3": transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_parameters={
            **_yarn(attention_factor=1.2, beta_fast=16.0, beta_slow=2.0), "rope_theta": 1_000_000.0}),
    }


def _as_rope_scaling(model_dir: str) -> None:
    """Rewrite config.json in the older form Qwen2.5's model cards give: `rope_theta` + `rope_scaling`."""
    path = os.path.join(model_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("yarn")
    dirs = {name: write_checkpoint(str(root / name), cfg, tiny_model_dir, seed=40 + n)
            for n, (name, cfg) in enumerate(_configs().items())}
    _as_rope_scaling(dirs["qwen2"])
    return dirs


def _engine(model_dir: str, **kw) -> Engine:
    kw = {"attention": "eager", "num_blocks": 64, **kw}
    return Engine(EngineArgs(model_dir, dtype="float32", block_size=16, **kw))


def test_checkpoints_read_their_yarn_scaling(checkpoints):
    qwen2 = ModelConfig.from_dir(checkpoints["qwen2"])
    assert qwen2.rope_scaling == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": OLD_LEN}
    assert qwen2.rope_theta == 1_000_000.0
    qwen3 = ModelConfig.from_dir(checkpoints["qwen3"])
    assert (qwen3.rope_scaling["rope_type"], qwen3.rope_scaling["attention_factor"]) == ("yarn", 1.2)


@pytest.mark.parametrize("name", ["llama", "llama_mscale", "qwen2", "qwen3"])
def test_logits_match_hf_at_every_position(checkpoints, name):
    engine = _engine(checkpoints[name])
    ref = hf_model(checkpoints[name])
    assert ref.model.rotary_emb.rope_type == "yarn" and ref.model.rotary_emb.attention_scaling != 1.0
    ids = random_prompt(200, seed=7, vocab=VOCAB)
    blocks = engine.block_manager.allocate(13)
    ours = engine.runner.score(ids, blocks)
    engine.block_manager.free(blocks)
    torch.testing.assert_close(ours, hf_logits(ref, ids), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("name, attention", [
    ("llama", "eager"), ("qwen2", "eager"), ("qwen3", "eager"), ("qwen2", "compiled"), ("qwen2", "flex-eager"),
])
def test_greedy_generation_matches_hf_generate(checkpoints, name, attention):
    """Chunked prefill (chunks of 16) and batched decode, prompts from shorter than OLD_LEN to well past it."""
    engine = _engine(checkpoints[name], attention=attention, chunk_size=16)
    assert engine.attention == attention
    ref = hf_model(checkpoints[name])
    prompts = [random_prompt(n, seed=n, vocab=VOCAB) for n in (1, 13, 40)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for prompt, c in zip(prompts, engine.generate(prompts, params)):
        assert c.token_ids == hf_greedy(ref, prompt, 24)
    engine.block_manager.check_no_leaks()


def test_two_tensor_parallel_ranks_generate_what_one_rank_does(checkpoints):
    """Each rank rotates its own heads with the same scaled cos/sin."""
    args = EngineArgs(checkpoints["qwen3"], dtype="float32", num_blocks=64, block_size=4, chunk_size=24,
                      attention="eager", weight_layout="row-major", torch_threads=1)
    prompts = [random_prompt(n, seed=n, vocab=VOCAB) for n in (9, 37)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in Engine(args).generate(prompts, params)]
    follower = Follower()
    try:
        with follower.engine(args) as engine:
            assert engine.tp.size == 2
            got = [c.token_ids for c in engine.generate(prompts, params)]
    finally:
        follower.close()
    assert got == want


# -- refusals -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, said", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling type 'dynamic' is not supported (supported: linear, llama3, yarn; not dynamic/longrope/su)"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "rope_parameters type 'longrope' is not supported (supported: linear, llama3, yarn;"),
    ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_scaling type 'su' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling.factor must be a positive number (missing)"),
    ({"rope_scaling": _yarn(factor=0)}, "rope_scaling.factor must be a positive number (got 0)"),
    ({"rope_parameters": _yarn(factor="4")}, 'rope_parameters.factor must be a positive number (got "4")'),
    ({"rope_scaling": _yarn(original_max_position_embeddings=0)},
     "rope_scaling.original_max_position_embeddings must be a positive number (got 0)"),
    ({"rope_scaling": _yarn(), "original_max_position_embeddings": "16"},
     'original_max_position_embeddings must be a positive number (got "16")'),
    ({"rope_scaling": _yarn(attention_factor=-1.0)}, "rope_scaling.attention_factor must be a positive number"),
    ({"rope_scaling": _yarn(beta_fast=0)}, "rope_scaling.beta_fast must be a positive number (got 0)"),
    ({"rope_scaling": _yarn(beta_slow="1")}, 'rope_scaling.beta_slow must be a positive number (got "1")'),
    ({"rope_scaling": _yarn(beta_fast=1.0, beta_slow=2.0)},
     "rope_scaling.beta_fast (1) must be at least beta_slow (2)"),
    ({"rope_scaling": _yarn(mscale=0.707)}, "rope_scaling.mscale needs both mscale and mscale_all_dim"),
    ({"rope_parameters": _yarn(mscale_all_dim=0.707)},
     "rope_parameters.mscale_all_dim needs both mscale and mscale_all_dim"),
    ({"rope_scaling": _yarn(attention_factor=1.0, mscale=1.0, mscale_all_dim=1.0)},
     "rope_scaling.attention_factor and mscale/mscale_all_dim are exclusive"),
    ({"rope_scaling": _yarn(truncate="false")}, 'rope_scaling.truncate must be true or false (got "false")'),
    ({"rope_scaling": _yarn(truncate=None)}, "rope_scaling.truncate must be true or false (got null)"),
    ({"rope_scaling": _yarn(llama_4_scaling_beta=0.1)},
     "rope_scaling.llama_4_scaling_beta is not a yarn parameter the engine applies"),
    ({"model_type": "phi3", "rope_scaling": _yarn()}, "rope_scaling type 'yarn' is not supported for phi3"),
])
def test_a_scaling_the_engine_does_not_apply_is_refused_naming_the_key(changes, said):
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_dict({"model_type": "llama", **SMALL, **changes}, source="m/config.json")
    assert str(refused.value).startswith(f"m/config.json: {said}")


def test_yarn_configs_as_published_are_read():
    """Qwen2.5 / Qwen3's card form, transformers 5's `rope_parameters`, and NousResearch's `finetuned` key
    (it picks their dynamic variant only); a top-level original_max_position_embeddings wins, as in HF."""
    qwen = ModelConfig.from_dict({"model_type": "qwen2", **SMALL, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    assert qwen.rope_scaling["factor"] == 4.0
    params = ModelConfig.from_dict({"model_type": "qwen3", **SMALL, "rope_parameters": {
        **_yarn(), "rope_theta": 5e5}})
    assert params.rope_theta == 5e5 and params.rope_scaling["rope_type"] == "yarn"
    nous = ModelConfig.from_dict({"model_type": "mistral", **SMALL, "rope_scaling": {**_yarn(), "finetuned": True}})
    assert nous.rope_scaling["finetuned"] is True
    top = ModelConfig.from_dict({"model_type": "llama", **SMALL, "rope_scaling": _yarn(),
                                 "original_max_position_embeddings": 64})
    assert top.rope_scaling["original_max_position_embeddings"] == 64


def test_yarn_serves_the_original_context_times_its_factor():
    """As vLLM derives it: a Qwen2.5 card's yarn (32K x 4) serves 128K though max_position_embeddings says 32K;
    other scalings, and a yarn that would shorten it, keep max_position_embeddings."""
    qwen = ModelConfig.from_dict({"model_type": "qwen2", **SMALL, "max_position_embeddings": 32768, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    assert qwen.context_limit == 131072
    assert EngineArgs("unused", max_model_len=200_000).context_length(qwen) == 131072
    assert EngineArgs("unused", max_model_len=4096).context_length(qwen) == 4096
    linear = ModelConfig.from_dict({"model_type": "llama", **SMALL, "max_position_embeddings": 512,
                                    "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert linear.context_limit == 512
    short = ModelConfig.from_dict({"model_type": "llama", **SMALL, "max_position_embeddings": 512,
                                   "rope_scaling": _yarn(original_max_position_embeddings=64, factor=2.0)})
    assert short.context_limit == 512


def test_a_qwen3_config_reads_head_dim_and_rope_theta_as_transformers_does():
    """Without head_dim a qwen3 config means 128 (Qwen3Config's default, not hidden / heads); with a theta both at
    the top level and in rope_parameters, rope_parameters' wins."""
    raw = {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 5000.0,
           "rope_parameters": {"rope_type": "default", "rope_theta": 7000.0}}
    ours = ModelConfig.from_dict(raw)
    theirs = transformers.Qwen3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert ours.head_dim == theirs.head_dim == 128
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 7000.0
