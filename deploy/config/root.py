"""The root of ``pools.yaml``: :class:`PDServeConfig` (every section, and the
checks across sections) and :func:`load_config` (read the YAML, apply CLI
overrides, validate). Bad input raises :class:`ConfigError` with one line that
names the key path (or file:line for YAML errors).

Relative file paths in the YAML are relative to the YAML file; in overrides,
relative to the working directory.
"""
from __future__ import annotations

import fnmatch
import os
from collections.abc import Hashable
from typing import Any, Mapping, Optional

import yaml
from pydantic import Field, ValidationError, model_validator

from deploy.config.base import PRESET_MODELS, ConfigError, FieldProblem, Section, config_error_from
from deploy.config.kv_cache import KVCacheSection
from deploy.config.kv_transfer import KVTransferSection
from deploy.config.model import ModelSection
from deploy.config.pools import PoolSection, PoolsSection
from deploy.config.ray import RaySection
from deploy.config.routing import RoutingSection
from deploy.config.security import SecuritySection
from deploy.config.server import ServerSection
from deploy.config.slo import SLOSection
from deploy.config.speculative import SpeculativeSection
from deploy.config.workload import WorkloadSection

DEPLOY_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG_PATH = os.path.join(DEPLOY_DIR, "pools.yaml")
PATH_KEYS = ("model.name", "pools.*.model", "speculative.draft.model", "workload.histogram_file",
             "security.tls_cert",
             "security.tls_key", "security.tls_client_ca", "security.internal_tls_cert",
             "security.internal_tls_key", "security.internal_tls_ca")
"""Keys whose values are file paths (made absolute when given as overrides)."""


class _Null:
    """The value of an override that sets its key to null (``--set server.metrics_port=null``): a None
    override means "flag not given" and is skipped."""

    def __repr__(self) -> str:
        return "NULL"

    def __reduce__(self) -> str:       # unpickled as this module's NULL, so `is NULL` holds in worker processes
        return "NULL"


NULL = _Null()


class PDServeConfig(Section):
    """A whole deployment. ``PDServeConfig.default()`` equals ``deploy/pools.yaml``."""

    model: ModelSection = Field(default_factory=ModelSection, description="Served model.")
    pools: PoolsSection = Field(default_factory=PoolsSection, description="Actor pools.")
    kv_cache: KVCacheSection = Field(default_factory=KVCacheSection,
                                     description="Paged KV cache of every pool.")
    kv_transfer: KVTransferSection = Field(default_factory=KVTransferSection,
                                           description="Prefill-to-decode KV shipping.")
    speculative: SpeculativeSection = Field(default_factory=SpeculativeSection,
                                            description="Speculative decoding on decode and colocated actors.")
    routing: RoutingSection = Field(default_factory=RoutingSection, description="Router policy.")
    slo: SLOSection = Field(default_factory=SLOSection, description="Latency targets.")
    workload: WorkloadSection = Field(default_factory=WorkloadSection,
                                      description="Traffic assumptions for the planner.")
    server: ServerSection = Field(default_factory=ServerSection, description="Public endpoint.")
    security: SecuritySection = Field(default_factory=SecuritySection,
                                      description="Token and TLS.")
    ray: RaySection = Field(default_factory=RaySection, description="Ray cluster to join.")

    @classmethod
    def default(cls) -> "PDServeConfig":
        """The embedded default: model small, 1 prefill + 1 decode, grpc + fp8, 127.0.0.1:50051."""
        return cls()

    def pool_model(self, name: str) -> str:
        """Model (preset name or absolute directory) served by pool ``name``."""
        return self._pool(name).model or self.model.name

    def transfer_codec(self) -> str:
        """The KV codec on the wire: `kv_transfer.compression`, or with an fp8 / int8 cache its blocks as stored."""
        # (kv_transfer.codec.stored_codec's names, without importing torch into the config)
        return f"{self.kv_cache.dtype}_cache" if self.kv_cache.dtype != "auto" else self.kv_transfer.compression

    def pool_kv_cache(self, name: str) -> KVCacheSection:
        """Effective KV cache of pool ``name``: its override's keys win; the
        budget comes from the override when it sets any budget key."""
        override = self._pool(name).kv_cache
        if override is None:
            return self.kv_cache
        merged = self.kv_cache.model_dump()
        if override.budget_keys():
            merged.update(memory_fraction=None, num_blocks=None, memory_gib=None)
        merged.update({key: getattr(override, key) for key in override.model_fields_set})
        return KVCacheSection.model_validate(merged)

    def pool_quantization(self, name: str) -> tuple[str, int, str]:
        """(quantization, int4 group size, the key that set the quantization) of pool ``name``: its
        overrides, else the model section's."""
        pool = self._pool(name)
        key = f"pools.{name}.quantization" if pool.quantization is not None else "model.quantization"
        return (pool.quantization or self.model.quantization,
                pool.quantization_group_size or self.model.quantization_group_size, key)

    def _pool(self, name: str) -> PoolSection:
        pool = dict(self.pools.items()).get(name)
        if pool is None:
            raise KeyError(f"no pool named {name!r}")
        return pool

    @model_validator(mode="after")
    def _cross_checks(self) -> "PDServeConfig":
        pools = self.pools.items()
        first = pools[0][0]
        for name, pool in pools[1:]:
            if self.pool_model(name) != self.pool_model(first):
                key = name if pool.model is not None else first
                raise FieldProblem(
                    f"/pools.{key}.model", f"all pools must serve the same model "
                    f"(pools.{first}: {self.pool_model(first)!r}, "
                    f"pools.{name}: {self.pool_model(name)!r})")
            mine, theirs = self.pool_kv_cache(name).block_size, self.pool_kv_cache(first).block_size
            if mine != theirs:
                key = name if pool.kv_cache and "block_size" in pool.kv_cache.model_fields_set \
                    else first
                raise FieldProblem(
                    f"/pools.{key}.kv_cache.block_size", f"pools must share one KV block "
                    f"layout (pools.{first}: {theirs}, pools.{name}: {mine})")
            mine, theirs = self.pool_kv_cache(name).dtype, self.pool_kv_cache(first).dtype
            if mine != theirs:
                key = name if pool.kv_cache and "dtype" in pool.kv_cache.model_fields_set else first
                raise FieldProblem(
                    f"/pools.{key}.kv_cache.dtype", f"pools must store KV the same way: blocks travel as "
                    f"stored (pools.{first}: {theirs}, pools.{name}: {mine})")
        if self.speculative.method != "off" and self.pool_kv_cache("decode").dtype == "fp8":
            raise FieldProblem("/speculative.method", "cannot run with kv_cache.dtype fp8: a block's fp8 scale "
                               "follows every row written to it, rejected proposals included, so greedy output "
                               "would change; use kv_cache.dtype int8 or auto")
        if self.routing.long_request_tokens is not None and self.pools.long_context is None:
            raise FieldProblem("/routing.long_request_tokens",
                               "needs a pools.long_context pool to route long requests to")
        if self.pools.long_context is not None and self.routing.long_request_tokens is None:
            raise FieldProblem("/pools.long_context",
                               "needs routing.long_request_tokens (which requests it serves)")
        if not self.server.is_loopback() and self.security.token is None:
            raise FieldProblem("/security.token", f"required when server.host is not loopback "
                               f"({self.server.host!r}); set security.token or security.token_env")
        return self


# ------------------------------------------------------------------- loading

class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last."""


def _mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, Hashable):
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a name, got a {type(key).__name__}", key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen[key] = loader.construct_object(value_node, deep=deep)
    return seen


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)

MAX_YAML_VALUES = 100_000
"""Most values (keys, scalars, lists, mappings) a config may hold once its YAML aliases are expanded: a
"billion laughs" document is a few lines that expand to billions, which validation (and the repr of a bad
value in its message) would walk."""


def _too_many_values(value: Any) -> bool:
    """True when ``value`` holds more than MAX_YAML_VALUES values, aliases expanded (stops counting there)."""
    stack, num_values = [value], 0
    while stack:
        item = stack.pop()
        num_values += 1
        if num_values > MAX_YAML_VALUES:
            return True
        if isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def read_yaml(path: str) -> dict:
    """The mapping in YAML file ``path`` ({} when empty); ConfigError otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=_Loader)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                          f"{exc.start})") from None
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        raise ConfigError(f"{where}: YAML error: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: YAML error: {exc}") from None
    if raw is None:
        return {}
    if _too_many_values(raw):
        raise ConfigError(f"{path}: more than {MAX_YAML_VALUES} values once its YAML aliases are expanded")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return raw


def parse_override(text: str) -> tuple[str, Any]:
    """``"pools.prefill.count=2"`` -> ``("pools.prefill.count", 2)``; the value
    is parsed as YAML (``auto`` stays a string, ``{a: 1}`` becomes a dict, ``null`` :data:`NULL`)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{text!r}: expected KEY=VALUE (e.g. pools.prefill.count=2)")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        return key.strip(), value
    if _too_many_values(parsed):
        raise ConfigError(f"{key.strip()}: more than {MAX_YAML_VALUES} values once its YAML aliases are "
                          "expanded", key.strip())
    return key.strip(), NULL if parsed is None else parsed


def _override_value(key: str, value: Any) -> Any:
    """Relative path values given on the command line are relative to the cwd."""
    if isinstance(value, str) and any(fnmatch.fnmatchcase(key, pat) for pat in PATH_KEYS):
        if value not in PRESET_MODELS:
            return os.path.abspath(os.path.expanduser(value))
    return value


def apply_overrides(raw: dict, overrides: Mapping[str, Any]) -> dict:
    """Set dotted ``overrides`` into the nested mapping ``raw`` (in place);
    ``None`` values are skipped so unset CLI flags can be passed through; :data:`NULL` sets null."""
    for key, value in overrides.items():
        if value is None:
            continue
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(f"{key}: malformed key in override", key)
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise ConfigError(f"{key}: cannot set a key under {prefix}, which is not a "
                                  "mapping", key)
            node = child
        node[parts[-1]] = None if value is NULL else _override_value(key, value)
    return raw


def load_config(path: Optional[str], overrides: Optional[dict[str, object]] = None
                ) -> PDServeConfig:
    """Read, override and validate a deployment config.

    Args:
        path: YAML file; None = the embedded default (same as deploy/pools.yaml).
        overrides: dotted keys from CLI flags, e.g. ``{"pools.prefill.count": 2}``;
            applied before validation, so they are checked like file values.
    Returns:
        The validated config.
    Raises:
        ConfigError: one line naming the key path (or file:line for YAML errors).
    """
    raw = read_yaml(path) if path is not None else {}
    apply_overrides(raw, overrides or {})
    base_dir = os.path.dirname(os.path.abspath(path)) if path is not None else None
    try:
        return PDServeConfig.model_validate(raw, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise config_error_from(exc, PDServeConfig) from None
