"""The configuration reference, written from the schema: every key of pools.yaml with its type, the
value the embedded default gives it, and its description.

    python -m deploy.config.reference > docs/configuration.md     # rewrite the page
    python -m deploy.config.reference --check docs/configuration.md  # exit 1 when the page is stale

The page is generated, never edited by hand; tests/deploy/test_config_reference.py fails when it
differs from what the schema gives.
"""
from __future__ import annotations

import argparse
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, SecretStr
from pydantic_core import PydanticUndefined

from deploy.config.root import PDServeConfig, load_config

HEADER = """# Configuration reference

Every key of `deploy/pools.yaml`, generated from the schema (`deploy/config/`) by
`python -m deploy.config.reference > docs/configuration.md`; a test fails when this page is
stale. "Default" is what the embedded `deploy/pools.yaml` gives the key (a pool or section that
file leaves out shows the schema's default). Set keys in a YAML file passed with `--config`, or
one at a time with `--set KEY=VALUE` (the value is read as YAML: `--set server.metrics_port=null` unsets a
key the file sets); an unknown key or a bad value is refused at start with a message naming the key.
"""


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    description: str


def rows(model: type[BaseModel] = PDServeConfig, value: BaseModel | None = None, prefix: str = "") -> list[Row]:
    """The leaf keys of ``model`` (a section), depth first in declaration order; ``value`` gives defaults."""
    if value is None and model is PDServeConfig:
        value = load_config(None)
    out: list[Row] = []
    for name, field in model.model_fields.items():
        current = getattr(value, name) if value is not None else _schema_default(field)
        section = _section_of(field.annotation)
        if typing.get_origin(field.annotation) is list and section is not None:    # a list of sections
            out.append(Row(f"{prefix}{name}", "list of entries", "[]" if not current else f"{len(current)}",
                           " ".join((field.description or "").split())))
            out += rows(section, None, f"{prefix}{name}[].")
        elif section is not None:
            out += rows(section, current if isinstance(current, section) else None, f"{prefix}{name}.")
        else:
            shown = "(required)" if value is None and field.is_required() else _show(current)
            out.append(Row(f"{prefix}{name}", _type_name(field.annotation), shown,
                           " ".join((field.description or "").split())))
    return out


def render() -> str:
    lines = [HEADER, "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| `{r.key}` | {r.type} | {r.default} | {_cell(r.description)} |" for r in rows()]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _schema_default(field):
    if field.default is not PydanticUndefined:
        return field.default
    return field.default_factory() if field.default_factory is not None else None


def _section_of(annotation) -> type[BaseModel] | None:
    """The section class a field holds (itself, or inside Optional), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _type_name(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        name = " or ".join(_type_name(a) for a in kept)
        return f"{name} or none" if len(kept) < len(args) else name
    if origin in (dict, typing.Dict):
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}" if args else "map"
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if annotation is SecretStr:
        return "secret string"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _show(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, SecretStr):
        return "(set)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{}" if not value else ", ".join(f"{k}: {v}" for k, v in value.items())
    text = str(value)
    return f"`{text}`" if text else '""'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.config.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="PAGE", help="exit 1 when PAGE differs from what the schema gives")
    args = parser.parse_args(argv)
    page = render()
    if args.check is None:
        sys.stdout.write(page)
        return 0
    if Path(args.check).read_text() != page:
        print(f"{args.check} is stale: run python -m deploy.config.reference > {args.check}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
