"""Shared pieces of the typed deployment config: the base of every section, the
number types, the error type, and the translation of pydantic errors into
one-line messages.

Every message has the shape ``<dotted.key.path>: <what is wrong>``, e.g.::

    pools.decode.max: must be >= pools.decode.min (4 > 2)
    kv_transfer.transport: unknown value 'udp' (allowed: grpc, tcp, torch, ray)
    pools.prefill.cuont: unknown key (allowed: count, min, max, ...)
    slo.ttft_p99_ms: expected a number, got 'fast'

Validators raise :class:`FieldProblem` to point at a key other than the one
pydantic is validating (cross-field checks name the key the user must edit).
"""
from __future__ import annotations

import os
import re
import typing
from typing import Annotated, Any

from pydantic import (AllowInfNan, BaseModel, BeforeValidator, ConfigDict, ValidationError,
                      ValidationInfo)

PRESET_MODELS = ("pydoc", "pydoc-draft", "tiny", "small")
"""Model names served from the embedded models instead of a directory: the trained `pydoc`
(engine/weights/pydoc), its speculative draft `pydoc-draft` and the random-weight presets."""
MIB = 1 << 20
GIB = 1 << 30


class ConfigError(Exception):
    """A deployment config that cannot be used. ``str(err)`` is one line.

    Attributes:
        key: dotted key path the message is about ("" for file-level errors).
    """

    def __init__(self, message: str, key: str = ""):
        super().__init__(message.replace("\n", " "))
        self.key = key


class FieldProblem(ValueError):
    """Raised inside validators: ``path`` is relative to the model being
    validated (``"max"``), or absolute when it starts with ``"/"``
    (``"/pools.decode.model"``)."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path
        self.message = message


def _reject_bool(value: Any) -> Any:
    # YAML turns `yes`/`true` into True, which pydantic would accept as 1.
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    return value


Int = Annotated[int, BeforeValidator(_reject_bool)]
Float = Annotated[float, BeforeValidator(_reject_bool), AllowInfNan(False)]


class Section(BaseModel):
    """Base of every config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


def resolve_path(value: str, info: ValidationInfo | None) -> str:
    """Expand ``~`` and make ``value`` absolute against the config file's
    directory (validation context ``base_dir``), else the working directory."""
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        base = (info.context or {}).get("base_dir") if info is not None else None
        path = os.path.join(base or os.getcwd(), path)
    return os.path.normpath(path)


def existing_file(value: str | None, info: ValidationInfo | None) -> str | None:
    """``value`` resolved as :func:`resolve_path` does; ValueError when no such file (None stays None)."""
    if value is None:
        return None
    path = resolve_path(value, info)
    if not os.path.isfile(path):
        raise ValueError(f"file not found: {path}")
    return path


# ---------------------------------------------------------------- formatting

def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _allowed_keys(root: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the model that owns the last element of ``loc``."""
    model: Any = root
    for part in loc[:-1]:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
        field = model.model_fields.get(part)
        if field is None:
            return []
        model = _model_in(field.annotation)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _model_in(annotation: Any) -> Any:
    """The BaseModel class inside ``Optional[...]``/``Union[...]``, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _describe(err: dict) -> str:
    """What is wrong, for one pydantic error dict (no key path)."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "literal_error":
        allowed = ", ".join(re.findall(r"'([^']*)'", str(ctx.get("expected", ""))))
        return f"unknown value {_show(value)} (allowed: {allowed})"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"expected an integer, got {_show(value)}"
    if kind in ("float_parsing", "float_type"):
        return f"expected a number, got {_show(value)}"
    if kind == "finite_number":
        return f"expected a finite number, got {_show(value)}"
    if kind in ("bool_parsing", "bool_type"):
        return f"expected true or false, got {_show(value)}"
    if kind == "string_type":
        return f"expected a string, got {_show(value)}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping, got {_show(value)}"
    if kind == "missing":
        return "required"
    bounds = {"greater_than": (">", "gt"), "greater_than_equal": (">=", "ge"),
              "less_than": ("<", "lt"), "less_than_equal": ("<=", "le")}
    if kind in bounds:
        op, name = bounds[kind]
        bound = ctx.get(name)
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return f"must be {op} {bound}, got {_show(value)}"
    msg = str(err.get("msg", kind))
    return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _join(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def config_error_from(exc: ValidationError, root: type[BaseModel]) -> ConfigError:
    """The first error of ``exc`` as a one-line :class:`ConfigError`."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(err["loc"])
    problem = (err.get("ctx") or {}).get("error")
    if isinstance(problem, FieldProblem):
        if problem.path.startswith("/"):
            key = problem.path[1:]
        else:
            key = _join(loc + tuple(p for p in problem.path.split(".") if p))
        message = problem.message.replace("{here}", _join(loc))
        return ConfigError(f"{key}: {message}", key)
    key = _join(loc)
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(root, loc)
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return ConfigError(f"{key}: unknown key{hint}", key)
    if err["type"] == "value_error" and isinstance(problem, ValueError):
        message = str(problem)
    else:
        message = _describe(err)
    return ConfigError(f"{key or '<top level>'}: {message}", key)
