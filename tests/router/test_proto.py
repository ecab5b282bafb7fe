"""The committed generated code is fresh, the public contract is intact,
and the proto passes `buf lint` when buf is installed."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proto.pdserve.v1 import generation_pb2 as pb

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    from proto.generate import generate
    written = generate(tmp_path)
    assert {p.name for p in written} >= {"generation_pb2.py", "kv_transfer_pb2.py", "worker_pb2.py"}
    for fresh in written:
        committed = (REPO / "proto/pdserve/v1" / fresh.name).read_text()
        assert committed == fresh.read_text(), f"{fresh.name} is stale: run .venv/bin/python -m proto.generate"


def _fields(message) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_public_contract_field_numbers():
    assert pb.DESCRIPTOR.package == "pdserve.v1"
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    generate = service.methods_by_name["Generate"]
    assert generate.server_streaming and not generate.client_streaming
    assert not service.methods_by_name["GetStats"].server_streaming
    assert _fields(pb.GenerateRequest) == {"request_id": 1, "prompt": 2, "token_ids": 3, "sampling": 4, "user": 5}
    assert [f.name for f in pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"].fields] == ["prompt", "token_ids"]
    assert _fields(pb.TokenIds) == {"ids": 1}
    assert _fields(pb.SamplingParams) == {
        "max_tokens": 1, "temperature": 2, "top_p": 3, "top_k": 4, "repetition_penalty": 5,
        "frequency_penalty": 6, "presence_penalty": 7, "seed": 8, "stop": 9, "ignore_eos": 10,
        "min_p": 11, "min_tokens": 12, "stop_token_ids": 13, "logit_bias": 14, "include_stop_str_in_output": 15,
        "skip_special_tokens": 16, "logprobs": 17, "prompt_logprobs": 18, "n": 19, "best_of": 20, "structured": 21,
    }
    assert _fields(pb.StructuredOutput) == {"json_schema": 1, "json_object": 2, "regex": 3, "choice": 4, "grammar": 5}
    assert [f.name for f in pb.StructuredOutput.DESCRIPTOR.oneofs_by_name["kind"].fields] == [
        "json_schema", "json_object", "regex", "choice", "grammar"]
    assert _fields(pb.GenerateResponse) == {
        "request_id": 1, "token_ids": 2, "text": 3, "finish_reason": 4, "usage": 5, "timing": 6,
        "index": 7, "logprobs": 8, "prompt_logprobs": 9, "stop_str": 10, "stop_token_id": 11,
    }
    assert _fields(pb.TokenLogprob) == {"token_id": 1, "logprob": 2, "top": 3}
    assert _fields(pb.TopLogprob) == {"token_id": 1, "logprob": 2}
    assert dict(pb.FinishReason.items()) == {
        "FINISH_REASON_UNSPECIFIED": 0, "FINISH_REASON_STOP": 1, "FINISH_REASON_LENGTH": 2,
        "FINISH_REASON_ABORT": 3,
    }


def test_optional_sampling_fields_have_presence():
    params = pb.SamplingParams(temperature=0.0)
    assert params.HasField("temperature") and not params.HasField("top_p")


def _buf() -> str | None:
    beside = Path(sys.executable).parent / "buf"      # buf-bin in the same virtualenv
    return os.environ.get("BUF") or shutil.which("buf") or (str(beside) if beside.exists() else None)


@pytest.mark.skipif(_buf() is None, reason="buf not installed (pip install buf-bin, or set BUF=/path/to/buf)")
def test_buf_lint_and_format():
    buf = _buf()
    for args in (["lint"], ["format", "--diff", "--exit-code"]):
        result = subprocess.run([buf, *args], cwd=REPO / "proto", capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
