"""The training corpus: the reST sources of the Python 3.11 documentation (Debian's `python3.11-doc`).

Obtained with the package manager this project already depends on (apt), so any Debian/Ubuntu
machine can rebuild it: `apt-get download python3.11-doc` + `dpkg-deb -x`. The text is under the
PSF License Agreement (see /usr/share/doc/python3.11-doc/copyright inside the package and
`license.rst.txt` in the corpus itself). Documents are split into train / held-out by the
sha256 of their path, so the split never depends on file order or content edits elsewhere.
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

PACKAGE = "python3.11-doc"
SOURCES_DIR = "usr/share/doc/python3.11/html/_sources"
HELDOUT_PERCENT = 5                     # documents whose path hash % 100 < this are held out
EXCLUDED = ("whatsnew/changelog.rst.txt",)   # issue-number lists, not prose


@dataclass(frozen=True)
class Corpus:
    train: list[tuple[str, str]]        # (relative path, cleaned text), sorted by path
    heldout: list[tuple[str, str]]
    deb_sha256: str
    deb_name: str
    sha256: str                         # over every cleaned document (path + text), in path order

    @property
    def num_train_bytes(self) -> int:
        return sum(len(t.encode()) for _, t in self.train)

    @property
    def num_heldout_bytes(self) -> int:
        return sum(len(t.encode()) for _, t in self.heldout)


def download_deb(cache_dir: str) -> str:
    """The package's .deb in `cache_dir` (downloaded with `apt-get download` when absent)."""
    os.makedirs(cache_dir, exist_ok=True)
    found = sorted(glob.glob(os.path.join(cache_dir, f"{PACKAGE}_*.deb")))
    if found:
        return found[-1]
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"apt-get not found: download the Debian package {PACKAGE} (any 3.11 revision) "
                           f"by hand into {cache_dir}, or pass --deb PATH")
    proc = subprocess.run(["apt-get", "download", PACKAGE], cwd=cache_dir, capture_output=True, text=True)
    found = sorted(glob.glob(os.path.join(cache_dir, f"{PACKAGE}_*.deb")))
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"`apt-get download {PACKAGE}` failed (rc {proc.returncode}): {proc.stderr.strip()} "
                           "(run `apt-get update` first, or pass --deb PATH)")
    return found[-1]


def extract_sources(deb: str, out_dir: str) -> str:
    if shutil.which("dpkg-deb") is None:
        raise RuntimeError("dpkg-deb not found: it is needed to unpack the corpus package")
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run(["dpkg-deb", "-x", deb, out_dir], check=True)
    root = os.path.join(out_dir, SOURCES_DIR)
    if not os.path.isdir(root):
        raise RuntimeError(f"{deb}: no {SOURCES_DIR} inside the package")
    return root


_ROLE = re.compile(r":[\w.+-]+(?::[\w.+-]+)*:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`__?")
_UNDERLINE = re.compile(r"^\s*([=\-~^*#+\"'`.:_])\1{3,}\s*$")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_KEEP_SIGNATURE = {"function", "method", "class", "exception", "attribute", "data", "decorator",
                   "classmethod", "staticmethod", "describe", "opcode", "cmdoption", "option"}
_VERSION_NOTE = {"versionadded": "New in version", "versionchanged": "Changed in version",
                 "deprecated": "Deprecated since version"}


def clean_rst(text: str) -> str:
    """reST → plain prose: roles and links keep their text; headings lose their rules;
    API directives keep their signature; comments, labels and directive options go."""
    out: list[str] = []
    in_options = False
    for line in text.splitlines():
        if _UNDERLINE.match(line):
            continue
        m = _DIRECTIVE.match(line)
        if m:
            indent, name, arg = m.groups()
            name = name.split(":")[-1]
            in_options = True
            if name in _KEEP_SIGNATURE and arg:
                out.append(indent + arg)
            elif name in _VERSION_NOTE:
                out.append(f"{indent}{_VERSION_NOTE[name]} {arg}.")
            continue
        if line.lstrip().startswith(".. "):          # comments, labels (.. _x:), footnote targets
            in_options = False
            continue
        if in_options and re.match(r"^\s+:[\w -]+:", line):
            continue
        in_options = False
        line = _LINK.sub(r"\1", _ROLE.sub(r"\1", line))
        out.append(line.rstrip())
    cleaned = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", cleaned).strip() + "\n"


def is_heldout(rel_path: str) -> bool:
    return int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def load_corpus(cache_dir: str, deb: str | None = None) -> Corpus:
    """Download (if needed), unpack, clean and split the corpus."""
    deb = deb or download_deb(cache_dir)
    with open(deb, "rb") as f:
        deb_sha = hashlib.sha256(f.read()).hexdigest()
    unpack = os.path.join(cache_dir, "unpacked-" + deb_sha[:12])
    root = os.path.join(unpack, SOURCES_DIR)
    if not os.path.isdir(root):
        root = extract_sources(deb, unpack)
    paths = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "**", "*.txt"), recursive=True))
    corpus_hash = hashlib.sha256()
    train, heldout = [], []
    for rel in paths:
        if rel in EXCLUDED:
            continue
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            text = clean_rst(f.read())
        corpus_hash.update(rel.encode() + b"\0" + text.encode() + b"\0")
        (heldout if is_heldout(rel) else train).append((rel, text))
    return Corpus(train, heldout, deb_sha, os.path.basename(deb), corpus_hash.hexdigest())
