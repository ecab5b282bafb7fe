"""Fenced code blocks of README.md and docs/**/*.md, and the shell syntax the docs use, taken apart.

`extract_blocks` finds every fenced block (tag, text, file, line, and the reason of a preceding
``<!-- not run: <reason> -->`` marker). `shell_commands` turns a shell block into simple commands
(argv lists): backslash continuations joined, comments dropped, ``NAME=value`` assignments and
``$NAME`` / ``${NAME}`` / ``${NAME/pattern/replacement}`` expanded (variables live on across the
blocks of one file: "``$COMMON`` as above"), ``for x in a b; do ... done`` unrolled, and lines split
on ``;``, ``&&``, ``||`` and ``|`` with ``>`` redirections dropped.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:(.*?)-->\s*$")
SEPARATORS = {";", "&&", "||", "|"}


@dataclass
class Block:
    file: str            # relative to the repository root
    line: int            # 1-based line of the opening fence
    tag: str             # the info string's first word, lowercased ("" when untagged)
    text: str
    not_run: str | None  # the marker's reason ("" when the marker has none); None without a marker

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class Command:
    argv: list[str]
    where: str           # file:line of the logical line it came from


def doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def extract_blocks(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    rel = str(path.relative_to(ROOT))
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(2), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)), len(lines))
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(prev)
        blocks.append(Block(rel, start + 1, m.group(3).lower(), "\n".join(lines[start + 1:end]),
                            marker.group(1).strip() if marker else None))
        i = end + 1
    return blocks


def expand(text: str, env: dict[str, str]) -> str:
    """``$NAME``, ``${NAME}``, ``${NAME/pattern/replacement}`` (first match, as bash); unknown names raise."""
    def value(name: str) -> str:
        if name not in env:
            raise KeyError(f"${name} is never set")
        return env[name]

    def repl(m: re.Match) -> str:
        if m.group("plain"):
            return value(m.group("plain"))
        name, pattern, replacement = m.group("name"), m.group("pattern"), m.group("replacement")
        return value(name) if pattern is None else value(name).replace(pattern, replacement or "", 1)
    return re.sub(r"\$(?:(?P<plain>[A-Za-z_]\w*)|\{(?P<name>[A-Za-z_]\w*)(?:/(?P<pattern>[^/}]*)/"
                  r"(?P<replacement>[^}]*))?\})", repl, text)


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """(line number, text) with backslash continuations joined and blank / comment-only lines dropped."""
    out, pending, first = [], "", 0
    for offset, raw in enumerate(block.text.split("\n"), start=1):
        if not pending:
            first = block.line + offset
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line and not line.startswith("#"):
            out.append((first, line))
    return out


def _split(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, argv, tokens = [], [], list(lexer)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in SEPARATORS:
            commands.append(argv)
            argv = []
        elif token in (">", ">>"):
            i += 1                            # the redirection's target
        else:
            argv.append(token)
        i += 1
    commands.append(argv)
    return [c for c in commands if c]


def shell_commands(block: Block, env: dict[str, str], substitutions: dict[str, str]) -> list[Command]:
    """The block's simple commands; assignments update ``env``. ``substitutions`` maps the exact text of
    each ``$(...)`` the docs may use to the value it stands for here; any other ``$(`` raises."""
    commands: list[Command] = []
    lines = logical_lines(block)
    i = 0
    while i < len(lines):
        number, line = lines[i]
        loop = re.fullmatch(r"for (\w+) in (.+?); do", line)
        if loop:
            end = next(j for j in range(i + 1, len(lines)) if lines[j][1] == "done")
            for value in shlex.split(loop.group(2)):
                env[loop.group(1)] = value
                for body_number, body_line in lines[i + 1:end]:
                    commands += _commands(body_line, f"{block.file}:{body_number}", env, substitutions)
            i = end + 1
            continue
        commands += _commands(line, f"{block.file}:{number}", env, substitutions)
        i += 1
    return commands


def _outside_single_quotes(line: str, fn) -> str:
    """Apply ``fn`` to the parts of ``line`` outside '...' (where the shell expands nothing)."""
    parts = re.split(r"('[^']*')", line)
    return "".join(part if part.startswith("'") else fn(part) for part in parts)


def _commands(line: str, where: str, env: dict[str, str], substitutions: dict[str, str]) -> list[Command]:
    def substitute(part: str) -> str:
        for text, value in substitutions.items():
            part = part.replace(f"$({text})", shlex.quote(value))
        if "$(" in part:
            raise ValueError(f"{where}: a command substitution the test has no stand-in for: {line}")
        return part
    out = []
    line = _outside_single_quotes(_outside_single_quotes(line, substitute), lambda part: expand(part, env))
    for argv in _split(line):
        if all(re.match(r"[A-Za-z_]\w*=", a) for a in argv):      # NAME=value [NAME=value ...]
            for a in argv:
                name, value = a.split("=", 1)
                env[name] = value
            continue
        out.append(Command(argv, where))
    return out
