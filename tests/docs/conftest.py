"""The stand-in servers the docs' snippets talk to (tests/docs/stand_ins.py)."""
from stand_ins import stand_ins  # noqa: F401
