"""docs/configuration.md is what the schema gives, key for key: it cannot drift from the code."""
from __future__ import annotations

from pathlib import Path

from deploy.config import PDServeConfig, load_config
from deploy.config.reference import main, render, rows

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_page_is_current():
    assert PAGE.read_text() == render(), "docs/configuration.md is stale: python -m deploy.config.reference > it"
    assert main(["--check", str(PAGE)]) == 0


def test_every_key_is_listed_once_and_each_one_loads():
    keys = [row.key for row in rows()]
    assert len(keys) == len(set(keys))
    for section in PDServeConfig.model_fields:
        assert any(key.startswith(section + ".") for key in keys), section
    assert {"server.http_limits.max_header_bytes", "pools.decode.max_batch_size", "security.token_env"} <= set(keys)
    cfg = load_config(None)
    for row in rows():                        # each key resolves to a value on a loaded config (or its pool's default)
        node = cfg
        for part in row.key.split(".")[:-1]:
            node = getattr(node, part, None)
        assert node is None or hasattr(node, row.key.rsplit(".", 1)[1]), row.key
        assert row.description, f"{row.key} has no description"


def test_a_stale_page_is_named(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(render().replace("`50051`", "`50052`"))
    assert main(["--check", str(stale)]) == 1
    assert "is stale" in capsys.readouterr().err
