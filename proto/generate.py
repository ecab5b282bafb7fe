"""Regenerate the committed *_pb2 modules from proto/pdserve/v1/*.proto.

    python -m proto.generate            # rewrite the committed files
    python -m proto.generate --out DIR  # write them under DIR (the freshness test compares)

protoc runs with `proto/` as the include root, so the protos import each other as
`pdserve/v1/<name>.proto` (what buf and reflection clients see); the generated Python
imports are then pointed at this repository's `proto.pdserve.v1` package.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent          # proto/
PACKAGE_DIR = "pdserve/v1"
_IMPORT = re.compile(r"^from pdserve\.v1 import ", re.MULTILINE)


def proto_files() -> list[str]:
    return sorted(f"{PACKAGE_DIR}/{p.name}" for p in (ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Write every generated module under `out/pdserve/v1/`; returns their paths."""
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out}", f"--pyi_out={out}",
           f"--grpc_python_out={out}", *proto_files()]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    written = sorted((out / PACKAGE_DIR).glob("*_pb2*.py*"))
    for path in written:
        path.write_text(_IMPORT.sub("from proto.pdserve.v1 import ", path.read_text()))
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write here instead of over the committed files")
    args = parser.parse_args(argv)
    if args.out is not None:
        for path in generate(args.out):
            print(path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            target = ROOT / PACKAGE_DIR / path.name
            target.write_text(path.read_text())
            print(target.relative_to(ROOT.parent))


if __name__ == "__main__":
    main()
