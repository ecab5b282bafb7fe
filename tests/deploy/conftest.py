"""Factories for deploy tests: write a pools.yaml into tmp_path and load it."""
from __future__ import annotations

import textwrap

import pytest


@pytest.fixture
def write_yaml(tmp_path):
    """write_yaml(text, name="pools.yaml") -> path of a dedented YAML file."""

    def write(text: str, name: str = "pools.yaml") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write


@pytest.fixture
def model_dir(tmp_path) -> str:
    """A directory that looks like an HF model to the config (has config.json)."""
    path = tmp_path / "my-model"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    return str(path)


@pytest.fixture
def pem_files(tmp_path) -> dict[str, str]:
    """Placeholder PEM files (the config only checks that they exist)."""
    files = {}
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("-----BEGIN PLACEHOLDER-----\n")
        files[name] = str(tmp_path / name)
    return files
