"""Every bad config fails with ONE line that starts with the key path."""
from __future__ import annotations

import os

import pytest

from deploy.config import ConfigError, load_config, parse_override

# (id, YAML text ({tmp} = the test's tmp dir), key, exact message or fragment after "key: ")
BAD_CONFIGS = [
    ("unknown-key", "pools:\n  prefill:\n    cuont: 2\n", "pools.prefill.cuont",
     "unknown key (allowed: count, min, max, resources, max_restarts, model, kv_cache, quantization, "
     "quantization_group_size, tensor_parallel, "
     "max_batch_tokens, chunk_tokens)"),
    ("unknown-section", "slos: {}\n", "slos", "unknown key (allowed: model, pools, kv_cache,"),
    ("unknown-resource-key", "pools:\n  decode:\n    resources: {gpus: 1}\n",
     "pools.decode.resources.gpus", "unknown key (allowed: num_cpus, num_gpus,"),
    ("wrong-type-number", "slo:\n  ttft_p99_ms: fast\n", "slo.ttft_p99_ms",
     "expected a number, got 'fast'"),
    ("wrong-type-int", "pools:\n  decode:\n    max_batch_size: 2.5\n",
     "pools.decode.max_batch_size", "expected an integer, got 2.5"),
    ("bool-as-count", "pools:\n  prefill:\n    count: yes\n", "pools.prefill.count",
     "expected an integer or 'auto', got True"),
    ("wrong-type-section", "pools: [1, 2]\n", "pools", "expected a mapping, got a list"),
    ("min-gt-max", "pools:\n  decode: {count: auto, min: 4, max: 2}\n", "pools.decode.max",
     "must be >= pools.decode.min (4 > 2)"),
    ("auto-without-max", "pools:\n  prefill: {count: auto, min: 1}\n", "pools.prefill.max",
     "required when count is 'auto'"),
    ("count-above-max", "pools:\n  prefill: {count: 5, max: 4}\n", "pools.prefill.count",
     "must be within pools.prefill.min..max (5 not in 1..4)"),
    ("count-below-min", "pools:\n  decode: {count: 1, min: 2, max: 4}\n", "pools.decode.count",
     "must be within pools.decode.min..max (1 not in 2..4)"),
    ("count-zero", "pools:\n  decode: {count: 0}\n", "pools.decode.count",
     "must be >= 1 or 'auto', got 0"),
    ("mismatched-models", "model: {name: small}\npools:\n  decode: {model: tiny}\n",
     "pools.decode.model",
     "all pools must serve the same model (pools.prefill: 'small', pools.decode: 'tiny')"),
    ("unknown-model", "model: {name: no-such-model}\n", "model.name",
     "'no-such-model' is neither a preset (pydoc, pydoc-draft, tiny, small) nor a model directory"),
    ("bad-enum-transport", "kv_transfer: {transport: udp}\n", "kv_transfer.transport",
     "unknown value 'udp' (allowed: grpc, tcp, torch, ray, nixl)"),
    ("bad-enum-compression", "kv_transfer: {compression: int4}\n", "kv_transfer.compression",
     "unknown value 'int4' (allowed: fp8, int8, none)"),
    ("bad-enum-dtype", "model: {dtype: float16}\n", "model.dtype",
     "unknown value 'float16' (allowed: float32, bfloat16, auto)"),
    ("block-size-not-pow2", "kv_cache: {block_size: 24}\n", "kv_cache.block_size",
     "must be a power of 2 in 1..256, got 24"),
    ("block-size-too-big", "kv_cache: {block_size: 512}\n", "kv_cache.block_size",
     "must be a power of 2 in 1..256, got 512"),
    ("block-size-mismatch", "pools:\n  decode:\n    kv_cache: {block_size: 32}\n",
     "pools.decode.kv_cache.block_size",
     "pools must share one KV block layout (pools.prefill: 16, pools.decode: 32)"),
    ("two-budgets", "kv_cache: {memory_fraction: 0.5, num_blocks: 100}\n", "kv_cache.num_blocks",
     "cannot be combined with kv_cache.memory_fraction"),
    ("fraction-above-1", "kv_cache: {memory_fraction: 1.5}\n", "kv_cache.memory_fraction",
     "must be <= 1, got 1.5"),
    ("chunk-too-big", "kv_transfer: {chunk_bytes: 128MiB}\n", "kv_transfer.chunk_bytes",
     "must be <= 67108864, got 134217728"),
    ("chunk-garbage", "kv_transfer: {chunk_bytes: lots}\n", "kv_transfer.chunk_bytes",
     "expected bytes (an integer or e.g. '4MiB'), got 'lots'"),
    ("layerwise-garbage", "kv_transfer: {layerwise: sometimes}\n", "kv_transfer.layerwise",
     "expected true or false, got 'sometimes'"),
    ("negative-slo", "slo: {tpot_p99_ms: -5}\n", "slo.tpot_p99_ms", "must be > 0, got -5"),
    ("infinite-deadline", "kv_transfer: {deadline_s: .inf}\n", "kv_transfer.deadline_s",
     "expected a finite number, got inf"),
    ("zero-rate", "workload: {arrival_rate_rps: 0}\n", "workload.arrival_rate_rps",
     "must be > 0, got 0"),
    ("missing-tls-file", "security: {tls_cert: {tmp}/nope.pem, tls_key: {tmp}/nope.key}\n",
     "security.tls_cert", "file not found: {tmp}/nope.pem"),
    ("cert-without-key", "security: {tls_cert: {tmp}/cert.pem}\n", "security.tls_key",
     "required when security.tls_cert is set"),
    ("client-ca-without-cert", "security: {tls_client_ca: {tmp}/ca.pem}\n", "security.tls_cert",
     "required when security.tls_client_ca is set"),
    ("non-loopback-no-token", "server: {host: 0.0.0.0}\n", "security.token",
     "required when server.host is not loopback ('0.0.0.0')"),
    ("token-env-unset", "security: {token_env: PDSERVE_TEST_UNSET_TOKEN}\n",
     "security.token_env", "environment variable PDSERVE_TEST_UNSET_TOKEN is not set"),
    ("port-range", "server: {port: 70000}\n", "server.port", "must be <= 65535, got 70000"),
    ("metrics-port-clash", "server: {port: 9000, metrics_port: 9000}\n", "server.metrics_port",
     "must differ from server.port (9000)"),
    ("long-without-pool", "routing: {long_request_tokens: 8192}\n",
     "routing.long_request_tokens", "needs a pools.long_context pool"),
    ("pool-without-threshold", "pools:\n  long_context: {count: 1}\n", "pools.long_context",
     "needs routing.long_request_tokens"),
    ("reserved-custom-resource", "pools:\n  prefill:\n    resources: {custom: {GPU: 1}}\n",
     "pools.prefill.resources.custom.GPU", "use resources.num_gpus instead"),
    ("chunk-over-batch", "pools:\n  prefill: {max_batch_tokens: 256, chunk_tokens: 512}\n",
     "pools.prefill.chunk_tokens", "must be <= pools.prefill.max_batch_tokens (512 > 256)"),
    ("missing-histogram", "workload: {histogram_file: lengths.jsonl}\n",
     "workload.histogram_file", "file not found: {tmp}/lengths.jsonl"),
    ("empty-host", "server: {host: ''}\n", "server.host",
     "must not be empty (0.0.0.0 = every interface, 127.0.0.1 = this machine only)"),
    ("empty-ray-address", "ray: {address: ''}\n", "ray.address",
     "must not be empty (unset or none = a local Ray on 127.0.0.1; auto = join the running cluster)"),
    ("bool-as-seconds", "routing: {max_queue_wait_s: yes}\n", "routing.max_queue_wait_s",
     "expected a number, got True"),
    ("infinite-queue-wait", "routing: {max_queue_wait_s: .inf}\n", "routing.max_queue_wait_s",
     "expected a finite number, got inf"),
    ("bool-as-interval", "routing: {kv_events_interval_s: on}\n", "routing.kv_events_interval_s",
     "expected a number, got True"),
    ("restarts-below-minus-one", "pools:\n  decode: {max_restarts: -2}\n",
     "pools.decode.max_restarts", "must be >= -1, got -2"),
]


@pytest.mark.parametrize("text, key, expected", [row[1:] for row in BAD_CONFIGS],
                         ids=[row[0] for row in BAD_CONFIGS])
def test_bad_config_names_the_key(write_yaml, pem_files, tmp_path, monkeypatch,
                                  text, key, expected):
    monkeypatch.delenv("PDSERVE_TEST_UNSET_TOKEN", raising=False)
    tmp = str(tmp_path)
    path = write_yaml(text.replace("{tmp}", tmp))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert info.value.key == key
    assert message.startswith(f"{key}: {expected.replace('{tmp}', tmp)}"), message


def test_table_covers_enough_error_classes():
    assert len(BAD_CONFIGS) >= 12


def test_yaml_syntax_error_gives_file_and_line(write_yaml):
    path = write_yaml("model:\n  name: small\npools:\n  prefill: {count: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}:"), message
    line = int(message[len(path) + 1:].split(":")[0])
    assert 4 <= line <= 5 and "YAML error" in message and "\n" not in message


def test_tab_indentation_gives_file_and_line(write_yaml):
    path = write_yaml("pools:\n\tprefill: {}\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2:"):
        load_config(path)


def test_duplicate_key_is_an_error(write_yaml):
    path = write_yaml("slo:\n  ttft_p99_ms: 100\n  ttft_p99_ms: 200\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3:.*duplicate key 'ttft_p99_ms'"):
        load_config(path)


def test_missing_file_and_non_mapping(write_yaml, tmp_path):
    missing = str(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match=rf"^{missing}: config file not found$"):
        load_config(missing)
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config(write_yaml("- just\n- a list\n"))


def test_non_utf8_file_is_one_line(write_yaml, tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"server:\n  host: caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not UTF-8 text \(byte 0xe9 at offset 19\)$"):
        load_config(str(path))


def test_a_list_as_key_gives_file_and_line(write_yaml):
    path = write_yaml("slo: {}\n? [ttft_p99_ms, tpot_p99_ms]\n: 100\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2:3: YAML error: a key must be a name, got a list$"):
        load_config(path)


BILLION_LAUGHS = "".join(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n"
                         for prev, name in zip("abcdefgh", "bcdefghi"))    # 9 ** 8 values from 8 lines


def test_alias_bomb_is_refused_before_validation_walks_it(write_yaml):
    path = write_yaml(f"a: &a [x]\n{BILLION_LAUGHS}pools: {{prefill: {{count: *i}}}}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: more than 100000 values once its YAML aliases are "
                       r"expanded$"):
        load_config(path)
    levels = ["&a [x]"] + [f"&{name} [{', '.join([f'*{prev}'] * 9)}]" for prev, name in zip("abcdefgh", "bcdefghi")]
    with pytest.raises(ConfigError, match=r"^pools\.prefill\.count: more than 100000 values once its YAML "
                       r"aliases are expanded$"):
        parse_override(f"pools.prefill.count=[{', '.join(levels)}]")


def test_empty_file_is_the_default(write_yaml):
    assert load_config(write_yaml("")) == load_config(None)


def test_errors_never_leak_the_token(write_yaml):
    path = write_yaml("security: {token: s3cret}\nserver: {port: nope}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "s3cret" not in str(info.value)
    assert "s3cret" not in repr(load_config(write_yaml("security: {token: s3cret}\n")))


def test_relative_paths_are_relative_to_the_config_file(tmp_path, monkeypatch, pem_files):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "pools.yaml").write_text("security: {tls_cert: ../cert.pem, tls_key: ../key.pem}\n")
    monkeypatch.chdir("/")
    config = load_config(str(conf / "pools.yaml"))
    assert config.security.tls_cert == os.path.join(str(tmp_path), "cert.pem")
