"""The draft-model method: a small model with the target's tokenizer drafts the proposals. Greedy output
equals the engine without speculation whether the draft is always right (the target drafting for
itself), never right (an unrelated random draft) or the trained pydoc-draft; both block pools are
empty afterwards; a draft with another vocabulary or tokenizer is refused naming the setting."""
from __future__ import annotations

import pytest

from engine import Engine, EngineArgs, SamplingParams
from engine.model.presets import TRAINED, hf_config, write_model_dir
from engine.spec.config import SpecConfig
from test_speculative import _looping_prompts, _staggered, _tokens
from window_support import one_thread

ARCH = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("draft")
    small = {**ARCH, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}
    return {"target": write_model_dir(str(root / "target"), hf_config(ARCH), seed=0, tokenizer_vocab=300),
            "draft": write_model_dir(str(root / "draft"), hf_config(small), seed=1, tokenizer_vocab=300),
            "other_vocab": write_model_dir(str(root / "vocab"), hf_config({**small, "vocab_size": 600}), seed=1,
                                           tokenizer_vocab=300),
            "other_tokenizer": write_model_dir(str(root / "tok"), hf_config(small), seed=1, tokenizer_vocab=280)}


def _draft(model: str, **kw) -> SpecConfig:
    return SpecConfig("draft", num_tokens=4, adaptive=False, draft_model=model, **kw)


@pytest.mark.parametrize("which", ["target", "draft"], ids=["always-right", "unrelated"])
def test_greedy_equals_no_speculation(dirs, which):
    kw = dict(dtype="float32", num_blocks=14, chunk_size=32, max_num_batched_tokens=128)    # and preemption
    base = Engine(EngineArgs(dirs["target"], **kw))
    spec = Engine(EngineArgs(dirs["target"], speculative=_draft(dirs[which]), **kw))
    prompts = _looping_prompts(6, 512, seed=1)
    params = [SamplingParams(max_tokens=10 + 5 * i, temperature=0.0, ignore_eos=True, n=2 if i == 3 else 1)
              for i in range(6)]
    assert _tokens(_staggered(spec, prompts, params)) == _tokens(_staggered(base, prompts, params))
    s = spec.speculator
    assert s.num_proposed > 0
    assert s.num_accepted == s.num_proposed if which == "target" else s.num_accepted < s.num_proposed
    assert spec.scheduler.num_preemptions > 0
    spec.block_manager.check_no_leaks()
    s.draft.block_manager.check_no_leaks()


def test_sampled_self_draft_accepts_everything_and_repeats_with_its_seed(dirs):
    spec = Engine(EngineArgs(dirs["target"], dtype="float32", num_blocks=128, speculative=_draft(dirs["target"])))
    prompts = _looping_prompts(3, 512, seed=2)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    first = [c.token_ids for c in spec.generate(prompts, params)]
    assert spec.speculator.num_accepted == spec.speculator.num_proposed > 0        # p == q: min(1, p/q) = 1
    assert [spec.generate([p], params)[0].token_ids for p in prompts] == first     # alone as batched
    spec.speculator.draft.block_manager.check_no_leaks()


def test_pydoc_with_its_trained_draft_equals_no_speculation():
    kw = dict(dtype="float32", num_blocks=128)
    base = Engine(EngineArgs(TRAINED["pydoc"], **kw))
    spec = Engine(EngineArgs(TRAINED["pydoc"], speculative=_draft("pydoc-draft"), **kw))
    prompts = ["The function returns", "import os\n\n\ndef main():\n"]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    assert [c.token_ids for c in spec.generate(prompts, params)] == \
        [c.token_ids for c in base.generate(prompts, params)]
    assert spec.speculator.num_accepted > 0
    spec.speculator.draft.block_manager.check_no_leaks()


@pytest.mark.parametrize("which, problem", [("other_vocab", "vocabulary"), ("other_tokenizer", "tokenizer.json")])
def test_a_draft_with_another_tokenizer_is_refused(dirs, which, problem):
    with pytest.raises(ValueError, match=f"speculative.draft.model: .*{problem}"):
        Engine(EngineArgs(dirs["target"], dtype="float32", num_blocks=32, speculative=_draft(dirs[which])))
    with pytest.raises(ValueError, match="speculative.draft.model: required"):
        SpecConfig("draft").validate()


def test_the_committed_draft_matches_its_record_and_shares_the_tokenizer():
    import json
    import os

    from bench.train.trainer import sha256_file
    draft_dir = TRAINED["pydoc-draft"]
    with open(os.path.join(draft_dir, "training.json"), encoding="utf-8") as f:
        record = json.load(f)
    for name, digest in record["sha256"].items():
        assert sha256_file(os.path.join(draft_dir, name)) == digest, name
    assert sha256_file(os.path.join(draft_dir, "tokenizer.json")) == \
        sha256_file(os.path.join(TRAINED["pydoc"], "tokenizer.json"))
    assert record["num_params"] < 1_000_000 and record["heldout"]["bits_per_byte"] > 0
