"""Typed deployment config: one YAML file (``deploy/pools.yaml``) drives a
deployment. Load it with :func:`load_config`; bad input raises
:class:`ConfigError` with a one-line message that names the key path.

One module per top-level section of the YAML, ``root`` for the whole file and
its loading, ``base`` for what every section shares. Object tree (pydantic v2
models, unknown keys forbidden)::

    PDServeConfig                       root.py
      model: ModelSection               model.py        name, dtype, attention, weight_layout, quantization,
                                                        quantization_group_size, quantize_lm_head, max_model_len
      pools: PoolsSection               pools.py        prefill, decode, long_context (optional)
        <pool>: PoolSection                             count, min, max, resources, max_restarts,
                                                        model, kv_cache, quantization, quantization_group_size
          resources: ResourcesSection                   num_cpus, num_gpus, torch_threads, custom
        prefill: PrefillPoolSection                     + max_batch_tokens, chunk_tokens
        decode, long_context: DecodePoolSection         + max_batch_size
      kv_cache: KVCacheSection          kv_cache.py     block_size, memory_fraction | num_blocks | memory_gib
      kv_transfer: KVTransferSection    kv_transfer.py  transport, compression, chunk_bytes, deadline_s
      speculative: SpeculativeSection   speculative.py  method, num_tokens, ngram {min, max}, draft {model,
                                                        num_tokens}, adaptive
      routing: RoutingSection           routing.py      mode, local_prefill_tokens, long_request_tokens, max_queue,
                                                        prefill_policy, decode_policy
      slo: SLOSection                   slo.py          ttft_p99_ms, tpot_p99_ms
      workload: WorkloadSection         workload.py     input_tokens_mean, output_tokens_mean, histogram_file,
                                                        arrival_rate_rps
      server: ServerSection             server.py       host, port, metrics_port, log_format
      security: SecuritySection         security.py     token, token_env, tls_cert, tls_key, tls_client_ca
      ray: RaySection                   ray.py          address, namespace, placement_timeout_s
"""
from deploy.config.base import PRESET_MODELS, ConfigError, FieldProblem, Section
from deploy.config.kv_cache import KVCacheSection
from deploy.config.kv_transfer import KVTransferSection
from deploy.config.model import ModelSection
from deploy.config.pools import DecodePoolSection, PoolSection, PoolsSection, PrefillPoolSection, ResourcesSection
from deploy.config.ray import RaySection
from deploy.config.root import (DEFAULT_CONFIG_PATH, PATH_KEYS, PDServeConfig, apply_overrides, load_config,
                                parse_override, read_yaml)
from deploy.config.routing import RoutingSection
from deploy.config.security import SecuritySection
from deploy.config.server import ServerSection
from deploy.config.slo import SLOSection
from deploy.config.speculative import NgramSection, SpeculativeSection
from deploy.config.workload import WorkloadSection, histogram_means, read_histogram

__all__ = [
    "DEFAULT_CONFIG_PATH", "PATH_KEYS", "PRESET_MODELS", "ConfigError", "DecodePoolSection", "FieldProblem",
    "KVCacheSection", "KVTransferSection", "ModelSection", "NgramSection", "PDServeConfig", "PoolSection",
    "PoolsSection", "PrefillPoolSection", "RaySection", "ResourcesSection", "RoutingSection", "SLOSection", "Section",
    "SecuritySection", "ServerSection", "SpeculativeSection", "WorkloadSection", "apply_overrides", "histogram_means",
    "load_config", "parse_override", "read_histogram", "read_yaml",
]
