"""Every fenced block of README.md and docs/**/*.md is run, checked, or marked as not runnable here.

Each block goes to exactly one rule (`rule_for`); a block no rule takes fails with its file:line.

- ``not run``: a block right after ``<!-- not run: <reason> -->`` (the reason is required).
- ``python``: executed. A block that names 127.0.0.1:8000 / :50051 talks to the ``quick_start`` stand-in
  server (tests/docs/conftest.py), one that names the documentation head address 203.0.113.5 to the
  ``cluster`` one; only the address and ports are rewritten. Engine-only blocks run as written.
- ``shell`` (bash, sh, shell, console, untagged): each simple command is checked by its program:
  ``pdserve`` is parsed by the real parser (config flags loaded, ``bench`` arguments parsed by the
  bench's own parser); ``python -m X`` must name a module whose argument parser takes the arguments
  (pytest: the paths must exist); ``curl`` runs against the stand-in server and must get a 2xx;
  ``make X`` needs the Makefile target. Anything else must be in `ALLOWED`, with the reason.
- ``yaml`` must parse, and a pools.yaml fragment must load through `deploy.config.load_config`;
  ``json`` must parse; ``text`` / ``output`` / ``log`` are shown, not run (output must be tagged so).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from stand_ins import CLUSTER_TOKEN
from snippets import ROOT, Block, Command, doc_files, extract_blocks, shell_commands

from deploy.cli import BENCHES, build_parser, config_from_args
from deploy.config import ConfigError, load_config

CLUSTER_HEAD = "203.0.113.5"      # RFC 5737 documentation address, as docs/multinode.md's Python example uses

# Commands that cannot run here, by argv prefix, with the reason.
ALLOWED = {
    (".venv/bin/ray",): "drives a Ray cluster of cloud or SSH nodes (ray up / exec / monitor / down); none here",
    (".venv/bin/hf", "download"): "downloads a checkpoint from the Hugging Face Hub; tests have no network",
    ("grpcurl",): "grpcurl is not installed here (the same server's HTTP and Python examples are run)",
    ("mkdir", "-p", "~/.pdserve/models"): "writes the operator's ~/.pdserve; a test must not touch $HOME",
    ("openssl", "rand"): "writes the operator's token to ~/.pdserve/token; a test must not touch $HOME",
    ("chmod", "600", "~/.pdserve/token"): "the operator's token file; a test must not touch $HOME",
}
# Command substitutions the docs use, what stands in for their output here, and why.
STAND_INS = {
    ".venv/bin/ray get-head-ip deploy/cluster.yaml": (CLUSTER_HEAD, "the head of a Ray cluster: the cluster stand-in"),
    "cat ~/.pdserve/token": (CLUSTER_TOKEN, "the operator's token: the cluster stand-in's"),
}
SHELL_TAGS = {"bash", "sh", "shell", "console", ""}
TEXT_TAGS = {"text", "output", "log"}


def rule_for(block: Block) -> str | None:
    if block.not_run is not None:
        return "not run"
    if block.tag in ("python", "py"):
        return "python"
    if block.tag in SHELL_TAGS:
        return "shell"
    if block.tag in ("yaml", "yml"):
        return "yaml"
    if block.tag == "json":
        return "json"
    if block.tag in TEXT_TAGS:
        return "text"
    return None


# --- python ------------------------------------------------------------------------------------

def target_of(text: str, stand_ins: dict) -> tuple[str, object] | None:
    """(the host the doc names, the stand-in server answering for it), or None (no server named)."""
    if CLUSTER_HEAD in text:
        return CLUSTER_HEAD, stand_ins["cluster"]
    if re.search(r"(127\.0\.0\.1|localhost):(8000|50051)", text):
        return "127.0.0.1", stand_ins["quick_start"]
    return None


def rewrite_address(text: str, host: str, stand_in) -> str:
    text = re.sub(r"localhost:(8000|50051)", r"127.0.0.1:\1", text).replace(host, "127.0.0.1")
    return text.replace(":8000", f":{stand_in.http_port}").replace(":50051", f":{stand_in.grpc_port}")


def run_python(block: Block, stand_ins: dict) -> None:
    text = block.text
    target = target_of(text, stand_ins)
    if target is not None:
        text = rewrite_address(text, *target)
    code = compile(text, block.where, "exec")
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, {"__name__": "__snippet__"})


# --- shell -------------------------------------------------------------------------------------

class _Parsed(Exception):
    pass


def parse_only(run) -> str | None:
    """Run ``run`` until its first `ArgumentParser.parse_args` returns: None if the arguments parsed,
    else the parser's complaint. Nothing after the parse runs."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *args, **kwargs):
        original(self, *args, **kwargs)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            run()
    except _Parsed:
        return None
    except SystemExit as e:
        return None if e.code in (0, None) else stderr.getvalue().strip().splitlines()[-1]
    finally:
        argparse.ArgumentParser.parse_args = original
    return "never parsed its arguments with argparse"


def check_pdserve(args: list[str]) -> str | None:
    if args[:1] == ["simulate"]:          # deploy.cli hands every flag to the simulator's own parser
        return parse_only(lambda: importlib.import_module("bench.simulate.cli").main(args[1:]))
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parsed = build_parser().parse_args(args)
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]
    if hasattr(parsed, "config"):
        try:
            config_from_args(parsed)
        except ConfigError as e:
            return f"config error: {e}"
    if parsed.command == "bench":
        return parse_only(lambda: importlib.import_module(BENCHES[parsed.what]).main(parsed.rest))
    return None


def check_python_module(args: list[str]) -> str | None:
    if len(args) < 2 or args[0] != "-m":
        return "only `python -m <module> ...` is checked"
    module, rest = args[1], args[2:]
    spec = importlib.util.find_spec(module)
    if spec is None:
        return f"no module {module}"
    if module == "pytest":
        missing = [a for a in rest if not a.startswith("-") and not (ROOT / a.split("::")[0]).exists()]
        return f"no such test path: {missing}" if missing else None
    if spec.submodule_search_locations is not None:
        module += ".__main__"
        if importlib.util.find_spec(module) is None:
            return f"package {args[1]} has no __main__"
    saved = sys.argv
    sys.argv = [module, *rest]
    try:
        return parse_only(lambda: runpy.run_module(module, run_name="__main__"))
    finally:
        sys.argv = saved


def run_curl(args: list[str], stand_ins: dict) -> str | None:
    target = target_of(" ".join(args), stand_ins)
    if target is None:
        return "curl to an address no stand-in server answers for"
    args = [rewrite_address(a, *target) for a in args]
    out = subprocess.run(["curl", *args, "--noproxy", "*", "--max-time", "10", "-w", "\n%{http_code}"],
                         capture_output=True, text=True, timeout=20)
    body, _, status = out.stdout.rpartition("\n")
    if out.returncode != 0 or not status.startswith("2"):
        return f"curl exit {out.returncode}, HTTP {status}: {body[:300]}"
    return None


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+):", (ROOT / "Makefile").read_text(), re.M))


def check_command(cmd: Command, stand_ins: dict) -> str | None:
    argv = cmd.argv
    program = argv[0]
    if program in ("pdserve", ".venv/bin/pdserve"):
        return check_pdserve(argv[1:])
    if program in ("python", "python3", ".venv/bin/python"):
        return check_python_module(argv[1:])
    if program == "curl":
        return run_curl(argv[1:], stand_ins)
    if program == "make":
        missing = [t for t in argv[1:] if not t.startswith("-") and t not in make_targets()]
        return f"no Makefile target {missing}" if missing else None
    if any(tuple(argv[:len(prefix)]) == prefix for prefix in ALLOWED):
        return None
    return f"no rule takes `{' '.join(argv)}` (run it, check it, or add it to ALLOWED with the reason)"


def check_shell(block: Block, env: dict, stand_ins: dict) -> list[str]:
    text = block.text
    if block.tag == "console":        # `$ command` lines, the rest is their output
        text = "\n".join(line[2:] for line in text.split("\n") if line.startswith("$ "))
    substitutions = {k: value for k, (value, _) in STAND_INS.items()}
    try:
        commands = shell_commands(Block(block.file, block.line, block.tag, text, None), env, substitutions)
    except (ValueError, KeyError) as e:
        return [f"{block.where}: {e} (output? tag the block ```text)"]
    problems = []
    for cmd in commands:
        problem = check_command(cmd, stand_ins)
        if problem:
            problems.append(f"{cmd.where}: {problem}")
    return problems


# --- yaml / json -------------------------------------------------------------------------------

def check_yaml(block: Block, tmp_path: Path) -> str | None:
    try:
        data = yaml.safe_load(block.text)
    except yaml.YAMLError as e:
        return f"bad YAML: {e}"
    sections = set(type(load_config(None)).model_fields)
    if isinstance(data, dict) and data and set(data) <= sections:       # a pools.yaml fragment
        path = tmp_path / f"{Path(block.file).stem}-{block.line}.yaml"
        path.write_text(block.text)
        try:
            load_config(str(path))
        except ConfigError as e:
            return f"pools.yaml fragment: {e}"
    return None


# --- the tests ---------------------------------------------------------------------------------

def check_file(path: Path, stand_ins: dict, tmp_path: Path) -> list[str]:
    env: dict[str, str] = {}        # shell variables live on across the blocks of one file
    problems = []
    for block in extract_blocks(path):
        rule = rule_for(block)
        if rule is None:
            problems.append(f"{block.where}: no rule for a ```{block.tag} block (tag it, or mark it "
                            "<!-- not run: <reason> -->)")
        elif rule == "not run" and not block.not_run:
            problems.append(f"{block.where}: `<!-- not run: -->` needs a reason")
        elif rule == "python":
            try:
                run_python(block, stand_ins)
            except Exception as e:      # noqa: BLE001 - any failure of a snippet is the finding
                problems.append(f"{block.where}: {type(e).__name__}: {e}")
        elif rule == "shell":
            problems += check_shell(block, env, stand_ins)
        elif rule == "yaml":
            problem = check_yaml(block, tmp_path)
            if problem:
                problems.append(f"{block.where}: {problem}")
        elif rule == "json":
            try:
                json.loads(block.text)
            except ValueError as e:
                problems.append(f"{block.where}: bad JSON: {e}")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_snippet_runs_or_says_why_not(path, stand_ins, tmp_path, monkeypatch):
    home = tmp_path / "home"                        # ~/.pdserve/token for the cluster examples
    (home / ".pdserve").mkdir(parents=True)
    (home / ".pdserve" / "token").write_text(CLUSTER_TOKEN + "\n")
    monkeypatch.setenv("HOME", str(home))
    problems = check_file(path, stand_ins, tmp_path)
    assert not problems, "\n".join(problems)


def test_every_allowed_command_and_stand_in_is_still_in_the_docs():
    text = "\n".join(b.text for path in doc_files() for b in extract_blocks(path))
    stale = [" ".join(prefix) for prefix in ALLOWED if " ".join(prefix) not in text]
    stale += [f"$({sub})" for sub in STAND_INS if f"$({sub})" not in text]
    assert not stale, f"ALLOWED / STAND_INS entries no doc uses any more: {stale}"
