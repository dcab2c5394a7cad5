"""The docs name only what exists: every relative link and every repository path in README.md and docs/*.md is a
file or folder of this checkout, every `sieve ...` command in their code blocks parses with sieve's own argument
parser (subcommand and flags), every `make TARGET` is a Makefile target and every `python scripts/X.py` a script."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from sieve.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])((?:sieve|tests|scripts|bench|docs)/[\w./-]*\w)")
FENCE = re.compile(r"^```[\w-]*\n(.*?)^```", re.S | re.M)


def links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def repo_paths(text: str) -> set[str]:
    """Paths into this repository named in the text (a test's `::name` and a trailing `.` or `,` left off)."""
    return {p.split("::")[0].rstrip(".,") for p in PATH.findall(text)}


def commands(text: str) -> list[str]:
    """The command lines of the page's code blocks, continuation lines joined, comment lines dropped; a shell loop's
    variable (`for dt in float32 bfloat16; do`) stands for its first value."""
    out = []
    for block in FENCE.findall(text):
        loops: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            loop = re.match(r"for (\w+) in (\S+)", line)
            if loop:
                loops[loop[1]] = loop[2]
            for name, value in loops.items():
                line = re.sub(rf"\${name}\b", value, line)
            if line and not line.startswith("#"):
                out.append(line)
    return out


def sieve_args(line: str) -> list[str] | None:
    """The arguments of a `sieve` command line (after any VAR=value prefixes), or None for other commands."""
    line = re.sub(r"\$\([^)]*\)", "X", line).replace("$G", "X")
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    if not words or words[0] != "sieve":
        return None
    return [w for w in words[1:] if w != "&"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_and_path_exists(page):
    text = page.read_text()
    missing = [t for t in links(text) if not (page.parent / t.split("#")[0]).exists()]
    missing += sorted(p for p in repo_paths(text) if not (ROOT / p).exists())
    assert not missing, f"{page.name} names what does not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_parses(page, capsys):
    parser = build_parser()
    makefile = (ROOT / "Makefile").read_text()
    bad = []
    for line in commands(page.read_text()):
        args = sieve_args(line)
        if args is not None:
            try:
                parser.parse_args(args)
            except SystemExit:
                bad.append(f"{line}: {capsys.readouterr().err.strip().splitlines()[-1]}")
            continue
        words = line.split()
        if words[0] == "make" and len(words) > 1 and not re.search(rf"^{re.escape(words[1])}:", makefile, re.M):
            bad.append(f"{line}: no such Makefile target")
        if words[0] in ("python", "python3") and len(words) > 1 and words[1].endswith(".py") and not (ROOT / words[1]).exists():
            bad.append(f"{line}: no such script")
    assert not bad, f"{page.name}: commands that do not run as written:\n" + "\n".join(bad)


def test_the_checker_catches_what_it_is_for():
    """A broken link, a missing path, an unknown flag and an unknown subcommand are all caught."""
    assert links("see [x](nowhere.md) and [y](https://example.com) and [z](#top)") == ["nowhere.md"]
    assert repo_paths("in `sieve/engine.py`, tests/test_spec.py::test_x and sieve/nothing_here.py.") == {
        "sieve/engine.py", "tests/test_spec.py", "sieve/nothing_here.py"}
    assert not (ROOT / "sieve/nothing_here.py").exists()
    parser = build_parser()
    assert sieve_args("SIEVE_CPU_ISA=avx2 sieve serve --model m &  # a comment") == ["serve", "--model", "m"]
    for args in (["serve", "--no-such-flag"], ["no-such-command"]):
        with pytest.raises(SystemExit):
            parser.parse_args(args)
    assert commands("```bash\nsieve serve \\\n  --port 1\n# note\n```\n") == ["sieve serve    --port 1"]
