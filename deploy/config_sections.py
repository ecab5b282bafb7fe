"""Top-level sections of ``pools.yaml`` other than ``pools`` and ``workload``:
model, kv_cache, kv_transfer, routing, slo, server, security, ray."""
from __future__ import annotations

import ipaddress
import os
import re
from typing import Annotated, Literal, Optional

from pydantic import (AfterValidator, BeforeValidator, Field, SecretStr, ValidationInfo,
                      field_validator, model_validator)

from deploy.config_base import PRESET_MODELS, FieldProblem, Float, Int, Section, resolve_path

MIB = 1 << 20
GIB = 1 << 30
MAX_CHUNK_BYTES = 64 * MIB


def check_model_name(value: str, info: ValidationInfo | None) -> str:
    """A preset name stays as is; anything else must be a local HF-format
    model directory (it holds ``config.json``) and becomes an absolute path."""
    if value in PRESET_MODELS:
        return value
    path = resolve_path(value, info)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{value!r} is neither a preset ({', '.join(PRESET_MODELS)}) "
                         f"nor a model directory with config.json ({path})")
    return path


class ModelConfig(Section):
    """Which model every pool serves."""

    name: Annotated[str, AfterValidator(check_model_name)] = Field(
        "small", description="Preset name (tiny, small) or a local Hugging Face-format "
        "model directory; relative paths are relative to the config file.")
    dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "auto", description="Weight and KV dtype; auto = bfloat16 on CUDA, float32 on CPU.")
    attention: Literal["auto", "compiled", "eager"] = Field(
        "auto", description="Decode attention: compiled = one Inductor kernel reading K/V through "
        "the block table (a few seconds to compile when a decode actor starts); eager = gather + bmm; "
        "auto = compiled on CPU, eager on CUDA.")
    max_model_len: Optional[Int] = Field(
        None, gt=0, description="Longest prompt + output in tokens; default: the model's "
        "max_position_embeddings.")


class KVCacheConfig(Section):
    """Paged KV cache: block size and the memory budget for blocks.

    Set at most one of ``memory_fraction``, ``num_blocks``, ``memory_gib``;
    with none set the budget is ``memory_fraction`` = 0.9.
    """

    block_size: Int = Field(16, description="Tokens per KV block; a power of 2 in 1..256. "
                            "Prefill and decode must agree (it fixes the transfer layout).")
    memory_fraction: Optional[Float] = Field(
        None, gt=0, le=1, description="Fraction of the memory left free after the weights "
        "load (GPU: the actor's device; CPU: the RAM share the worker is given) used for blocks.")
    num_blocks: Optional[Int] = Field(None, ge=1,
                                      description="Exact number of KV blocks per actor.")
    memory_gib: Optional[Float] = Field(None, gt=0, description="KV block memory per actor, GiB.")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if not 1 <= value <= 256 or value & (value - 1):
            raise ValueError(f"must be a power of 2 in 1..256, got {value}")
        return value

    @model_validator(mode="after")
    def _one_budget(self) -> "KVCacheConfig":
        chosen = self.budget_keys()
        if len(chosen) > 1:
            raise FieldProblem(chosen[1], f"cannot be combined with {{here}}.{chosen[0]} "
                               "(set one of memory_fraction, num_blocks, memory_gib)")
        return self

    def budget_keys(self) -> list[str]:
        """Names of the budget fields that are set, in declaration order."""
        names = ("memory_fraction", "num_blocks", "memory_gib")
        return [name for name in names if getattr(self, name) is not None]

    def resolve_num_blocks(self, bytes_per_block: int, free_bytes: int = 0) -> int:
        """Blocks one actor allocates.

        Args:
            bytes_per_block: KV bytes of one block over all layers (K and V).
            free_bytes: memory left after weights; only used for memory_fraction.
        Returns:
            The block count (0 when the budget does not fit one block).
        """
        assert bytes_per_block > 0
        if self.num_blocks is not None:
            return self.num_blocks
        if self.memory_gib is not None:
            return int(self.memory_gib * GIB) // bytes_per_block
        fraction = 0.9 if self.memory_fraction is None else self.memory_fraction
        return int(fraction * free_bytes) // bytes_per_block


def _parse_bytes(value: object) -> object:
    """Accept ints or strings like ``4MiB``, ``512KiB``, ``1048576``."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*", value)
        if not match:
            raise ValueError(f"expected bytes (an integer or e.g. '4MiB'), got {value!r}")
        scale = {"B": 1, "KiB": 1 << 10, "MiB": MIB, "GiB": GIB}[match.group(2) or "B"]
        return int(match.group(1)) * scale
    return value


class KVTransferConfig(Section):
    """How prefill actors ship KV blocks to decode actors."""

    transport: Literal["grpc", "torch", "ray"] = Field(
        "grpc", description="grpc (streaming service on the decode actor), torch "
        "(torch.distributed: NCCL on CUDA, gloo on CPU) or ray (object store, same node).")
    compression: Literal["fp8", "none"] = Field(
        "fp8", description="fp8 (float8_e4m3fn + per-block scales) or none (bit-exact).")
    chunk_bytes: Annotated[Int, BeforeValidator(_parse_bytes)] = Field(
        4 * MIB, gt=0, le=MAX_CHUNK_BYTES,
        description="Largest message on the wire, bytes (also '4MiB'); at most 64 MiB.")
    deadline_s: Float = Field(30.0, gt=0, description="Seconds before a transfer fails and "
                              "the router re-dispatches the request.")


class RoutingConfig(Section):
    """How the router picks actors for a request."""

    local_prefill_tokens: Int = Field(
        0, ge=0, description="Prompts at most this long prefill on the decode actor "
        "itself (no KV transfer); 0 = off.")
    long_request_tokens: Optional[Int] = Field(
        None, gt=0, description="Requests whose prompt + max_tokens exceed this go to "
        "pools.long_context (which must then be configured).")
    max_queue: Int = Field(1024, ge=1, description="Requests waiting in the router before "
                           "new ones get RESOURCE_EXHAUSTED.")
    prefill_policy: Literal["prefix_then_load"] = Field(
        "prefix_then_load", description="Longest cached prefix, then fewest queued prompt tokens.")
    decode_policy: Literal["most_free_blocks"] = Field(
        "most_free_blocks",
        description="Admit where prompt + max_tokens fit; prefer most free blocks.")


class SLOConfig(Section):
    """Latency targets the planner and autoscaler size the pools for."""

    ttft_p99_ms: Float = Field(1000.0, gt=0, description="p99 time to first token, ms.")
    tpot_p99_ms: Float = Field(100.0, gt=0, description="p99 time per output token, ms.")


class ServerConfig(Section):
    """The router's public gRPC endpoint and its metrics."""

    host: str = Field("127.0.0.1", description="Bind address; non-loopback needs security.token.")
    port: Int = Field(50051, ge=1, le=65535, description="gRPC port.")
    metrics_port: Optional[Int] = Field(None, ge=1, le=65535, description="Prometheus "
                                        "/metrics port; unset = no metrics server.")
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")

    @model_validator(mode="after")
    def _distinct_ports(self) -> "ServerConfig":
        if self.metrics_port == self.port:
            raise FieldProblem("metrics_port", f"must differ from server.port ({self.port})")
        return self

    def is_loopback(self) -> bool:
        """True when ``host`` only accepts connections from this machine."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


class SecurityConfig(Section):
    """Shared token (router and internal endpoints) and TLS files."""

    token: Optional[SecretStr] = Field(None, description="Shared bearer token; prefer token_env.")
    token_env: Optional[str] = Field(None,
                                     description="Environment variable holding the token.")
    tls_cert: Optional[str] = Field(None, description="PEM server certificate (with tls_key).")
    tls_key: Optional[str] = Field(None, description="PEM private key of tls_cert.")
    tls_client_ca: Optional[str] = Field(None, description="PEM CA bundle; set = clients need "
                                         "a certificate signed by it (mutual TLS).")

    @field_validator("tls_cert", "tls_key", "tls_client_ca")
    @classmethod
    def _file_exists(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        if value is None:
            return None
        path = resolve_path(value, info)
        if not os.path.isfile(path):
            raise ValueError(f"file not found: {path}")
        return path

    @model_validator(mode="after")
    def _pairs(self) -> "SecurityConfig":
        if self.token_env is not None:
            if self.token is not None:
                raise FieldProblem("token_env", "cannot be combined with security.token")
            value = os.environ.get(self.token_env)
            if not value:
                raise FieldProblem("token_env", f"environment variable {self.token_env} "
                                   "is not set or empty")
            self.token = SecretStr(value)
        if self.token is not None and not self.token.get_secret_value():
            raise FieldProblem("token", "must not be empty")
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "tls_key" if self.tls_key is None else "tls_cert"
            other = "tls_cert" if missing == "tls_key" else "tls_key"
            raise FieldProblem(missing, f"required when security.{other} is set")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise FieldProblem("tls_cert", "required when security.tls_client_ca is set")
        return self


class RayConfig(Section):
    """Which Ray cluster the pools run on."""

    address: Optional[str] = Field(None, description="Ray address: unset = start a local "
                                   "Ray; 'auto' = join the running cluster (ray up).")
    namespace: str = Field("pdserve", description="Ray namespace of the actors.")
