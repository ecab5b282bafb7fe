"""Shipped configs load; defaults, overrides and cross-section checks are exact (deploy/config/root.py)."""
from __future__ import annotations

import glob
import os

import pytest
from pydantic import BaseModel

from deploy.config import DEFAULT_CONFIG_PATH, ConfigError, PDServeConfig, load_config, parse_override
from deploy.launcher import transfer_settings

DEPLOY_DIR = os.path.dirname(DEFAULT_CONFIG_PATH)
SHIPPED = [DEFAULT_CONFIG_PATH] + sorted(glob.glob(os.path.join(DEPLOY_DIR, "examples", "*.yaml")))


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_every_shipped_pools_yaml_loads(path, monkeypatch):
    monkeypatch.setenv("PDSERVE_TOKEN", "test-token")  # placement.yaml uses token_env
    config = load_config(path)
    assert config.pool_model("prefill") == config.pool_model("decode")


def test_shipped_examples_exist():
    names = {os.path.basename(p) for p in SHIPPED}
    assert {"pools.yaml", "rag.yaml", "chat.yaml", "placement.yaml"} <= names


def test_pools_yaml_is_the_embedded_default():
    default = PDServeConfig.default()
    assert load_config(DEFAULT_CONFIG_PATH) == default == load_config(None)
    assert default.model.name == "pydoc"
    assert default.pools.prefill.count == 1 and default.pools.decode.count == 1
    assert default.pools.long_context is None
    assert (default.kv_transfer.transport, default.kv_transfer.compression) == ("grpc", "fp8")
    assert (default.server.host, default.server.port) == ("127.0.0.1", 50051)
    assert default.kv_transfer.chunk_bytes == 4 << 20
    assert default.kv_transfer.layerwise is True
    assert default.kv_cache.block_size == 16


def test_rag_is_prefill_heavy_and_chat_decode_heavy():
    rag = load_config(os.path.join(DEPLOY_DIR, "examples", "rag.yaml"))
    chat = load_config(os.path.join(DEPLOY_DIR, "examples", "chat.yaml"))
    assert (rag.workload.input_tokens_mean, rag.workload.output_tokens_mean) == (2000, 100)
    assert (chat.workload.input_tokens_mean, chat.workload.output_tokens_mean) == (100, 500)
    for config in (rag, chat):
        assert config.pools.prefill.is_auto and config.pools.decode.is_auto
    assert rag.pools.prefill.bounds() == (1, 4) and chat.pools.decode.bounds() == (1, 4)


def test_placement_pins_pools_to_node_types(monkeypatch):
    monkeypatch.setenv("PDSERVE_TOKEN", "t0k")
    config = load_config(os.path.join(DEPLOY_DIR, "examples", "placement.yaml"))
    assert config.pools.prefill.resources.custom == {"prefill_node": 1.0}
    assert config.pools.decode.resources.custom == {"decode_node": 1.0}
    assert config.security.token.get_secret_value() == "t0k"
    assert config.kv_transfer.chunk_bytes == 16 << 20
    assert config.pool_kv_cache("long_context").memory_fraction == 0.95


def test_overrides_win_over_file_values(write_yaml):
    path = write_yaml("pools:\n  prefill: {count: 1}\nkv_transfer: {transport: grpc}\n")
    config = load_config(path, {"pools.prefill.count": 2, "kv_transfer.transport": "torch",
                                "pools.decode.resources.custom.decode_node": 1,
                                "slo.ttft_p99_ms": None})  # None = flag not given
    assert config.pools.prefill.count == 2
    assert config.kv_transfer.transport == "torch"
    assert config.pools.decode.resources.custom == {"decode_node": 1.0}
    assert config.slo.ttft_p99_ms == 1000.0


def test_overrides_are_validated(write_yaml):
    path = write_yaml("pools:\n  decode: {count: auto, min: 1, max: 4}\n")
    with pytest.raises(ConfigError, match=r"^pools\.decode\.max: must be >= pools\.decode\.min "
                       r"\(6 > 2\)$"):
        load_config(path, {"pools.decode.min": 6, "pools.decode.max": 2})
    with pytest.raises(ConfigError, match=r"^kv_transfer\.transport: unknown value 'udp'"):
        load_config(None, {"kv_transfer.transport": "udp"})
    assert load_config(None, {"kv_transfer.transport": "tcp"}).kv_transfer.transport == "tcp"
    with pytest.raises(ConfigError, match=r"^pools\.prefill\.cuont: unknown key"):
        load_config(None, {"pools.prefill.cuont": 2})
    with pytest.raises(ConfigError, match=r"^pools\.decode\.count\.x: cannot set a key under "
                       r"pools\.decode\.count, which is not a mapping$"):
        load_config(path, {"pools.decode.count.x": 1})
    with pytest.raises(ConfigError, match=r"^pools\.prefill\.count: expected an integer or"):
        load_config(None, {"pools.prefill.count.x": 1})


def test_cli_strings_are_coerced_or_rejected():
    config = load_config(None, dict([parse_override("pools.prefill.count=3"),
                                     parse_override("pools.decode.count=auto"),
                                     parse_override("pools.decode.min=1"),
                                     parse_override("pools.decode.max=8"),
                                     parse_override("kv_transfer.chunk_bytes=1MiB")]))
    assert config.pools.prefill.count == 3 and config.pools.decode.bounds() == (1, 8)
    assert config.kv_transfer.chunk_bytes == 1 << 20
    layerwise_off = load_config(None, {"kv_transfer.layerwise": "false"})
    assert layerwise_off.kv_transfer.layerwise is False
    assert transfer_settings(layerwise_off, "token", "127.0.0.1").layerwise is False     # what the actors get
    assert parse_override("pools.prefill.resources.custom={prefill_node: 1}") == (
        "pools.prefill.resources.custom", {"prefill_node": 1})
    assert load_config(None, {"server.port": "6000"}).server.port == 6000
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_override("pools.prefill.count")


def test_a_null_override_sets_null_where_an_unset_flag_is_skipped(write_yaml):
    path = write_yaml("server: {metrics_port: 9100}\nrouting: {max_prefill_backlog_tokens: 4096}\n")
    config = load_config(path, dict([parse_override("server.metrics_port=null"),
                                     parse_override("routing.max_prefill_backlog_tokens=~"),
                                     parse_override("server.http_port=null")]))
    assert config.server.metrics_port is None and config.server.http_port is None
    assert config.routing.max_prefill_backlog_tokens is None
    assert load_config(path, {"server.metrics_port": None}).server.metrics_port == 9100    # flag not given
    with pytest.raises(ConfigError, match=r"^pools\.prefill\.count: expected an integer or 'auto', got None$"):
        load_config(None, dict([parse_override("pools.prefill.count=null")]))


def test_ray_address_none_or_local_is_a_local_ray(write_yaml):
    # --help says `--address none` is a local Ray on 127.0.0.1; Ray itself would dial "none"
    for value in ("none", "local"):
        assert load_config(None, {"ray.address": value}).ray.address is None
    assert load_config(write_yaml("ray: {address: local}\n")).ray.address is None
    assert load_config(None, {"ray.address": "auto"}).ray.address == "auto"


def test_override_paths_are_relative_to_cwd(model_dir, monkeypatch):
    monkeypatch.chdir(os.path.dirname(model_dir))
    config = load_config(None, {"model.name": "my-model"})
    assert config.model.name == model_dir
    assert config.pool_model("decode") == model_dir


def test_pool_model_override_must_match(model_dir, write_yaml):
    same = write_yaml(f"model: {{name: {model_dir}}}\npools:\n  decode: {{model: {model_dir}/}}\n")
    assert load_config(same).pool_model("decode") == model_dir
    other = write_yaml(f"pools:\n  prefill: {{model: {model_dir}}}\n")
    with pytest.raises(ConfigError, match=rf"^pools\.prefill\.model: all pools must serve the "
                       rf"same model \(pools\.prefill: '{model_dir}', pools\.decode: 'pydoc'\)"):
        load_config(other)


def test_pool_kv_cache_inherits_unset_keys():
    config = load_config(None, {"kv_cache.block_size": 32, "kv_cache.memory_gib": 2,
                                "pools.prefill.kv_cache": {"num_blocks": 64},
                                "pools.decode.kv_cache": {"block_size": 32}})
    prefill, decode = config.pool_kv_cache("prefill"), config.pool_kv_cache("decode")
    assert (prefill.block_size, prefill.num_blocks, prefill.memory_gib) == (32, 64, None)
    assert (decode.block_size, decode.memory_gib) == (32, 2.0)


def _models(model: type[BaseModel]):
    yield model
    for field in model.model_fields.values():
        for arg in [field.annotation, *getattr(field.annotation, "__args__", ())]:
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield from _models(arg)


def test_every_field_is_documented_and_unknown_keys_forbidden():
    for model in _models(PDServeConfig):
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
