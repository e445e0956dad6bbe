"""Every page of the documentation runs as pasted: the ```python blocks of README.md and of each page under docs/,
in order, in one fresh Python process with no environment variables of ours (a new user's first session).

Each page's blocks are written to one script and run with this interpreter (`sys.executable`) in an empty
directory, with only `PATH` and `HOME` set: no `XLA_FLAGS`, no `JAX_PLATFORMS` (so what the pages say about
devices is what runs; a page that needs 8 CPU devices asks for them in its first block). ```bash, ```text and
other fences are not run; a page that imports MaxText or Kauldron runs only where that package imports.
Markdown pages hold no `>>>` examples (those live in docstrings, which `tests/test_docs.py` runs).

Every line inside a ``` fence is at most `MAX_WIDTH` characters, so that code reads without scrolling on GitHub
and in the site's page column.

`python tests/test_docs_pages.py docs/getting_started.md` prints the script of one page.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *ROOT.glob("docs/**/*.md")]
               if "_build" not in p.parts and "_autosummary" not in p.parts)
MAX_WIDTH = 100
TIMEOUT_S = 300
OPTIONAL = ("maxtext", "kauldron")
"""Packages zero_optax does not depend on: a page whose Python imports one runs only where it is installed."""

_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)")


def fences(text: str) -> list[tuple[str, int, list[str]]]:
    """The fenced blocks of a Markdown page, in order: (info string, first line number, lines of the body with
    the fence's indentation removed). A block opens with three or more backticks (or tildes) and closes with a
    line of at least as many of the same character and nothing else."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, start = len(m["indent"]), m["fence"], i + 1
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        i += 1
        body = []
        while i < len(lines) and not close.match(lines[i]):
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            i += 1
        blocks.append((m["info"], start, body))
        i += 1
    return blocks


def script(page: str) -> str:
    """The page's ```python blocks, in order, as one script; each block starts with a comment naming its line."""
    out = []
    for info, line, body in fences((ROOT / page).read_text()):
        if info == "python":
            out.append(f"# --- {page}:{line}\n" + "\n".join(body) + "\n")
    return "\n".join(out)


def _needs(source: str) -> list[str]:
    return [name for name in OPTIONAL if re.search(rf"^\s*(import|from)\s+[\w.]*\b{name}\b", source, re.M)]


def _importable(name: str) -> bool:
    probe = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.parametrize("page", [p for p in PAGES if "```python" in (ROOT / p).read_text()])
def test_page_runs_as_pasted(page, tmp_path):
    source = script(page)
    for name in _needs(source):
        if not _importable(name):
            pytest.skip(f"{page} needs {name}, which is not installed")
    path = tmp_path / "page.py"
    path.write_text(source)
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home)}
    try:
        run = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{page} ran for more than {TIMEOUT_S} s\n{(e.stderr or b'')[-3000:]!r}")
    assert run.returncode == 0, (f"{page}'s Python blocks fail when run in order (exit {run.returncode}); "
                                 f"the stderr's tail:\n{run.stderr[-4000:]}")


@pytest.mark.parametrize("page", PAGES)
def test_code_lines_fit_the_column(page):
    wide = [f"{page}:{line + k}: {len(text)} characters"
            for _, line, body in fences((ROOT / page).read_text())
            for k, text in enumerate(body, start=1) if len(text) > MAX_WIDTH]
    assert not wide, f"code lines wider than {MAX_WIDTH} characters:\n" + "\n".join(wide)


def test_pages_hold_no_doctest_examples():
    """`>>>` examples belong in docstrings (`tests/test_docs.py` runs them); in a page they would run nowhere."""
    found = [f"{p}:{n}" for p in PAGES for n, line in enumerate((ROOT / p).read_text().splitlines(), 1)
             if line.lstrip().startswith(">>> ")]
    assert not found, f"doctest examples in pages, which nothing runs: {found}"


if __name__ == "__main__":
    print(script(sys.argv[1]), end="")
