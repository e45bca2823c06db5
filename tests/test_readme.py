"""README.md's code blocks run as written, each with the launch command beside it, and so
do those the README sent to the docs; the README stays short.

The blocks are read at collection time from all of README.md and from the sections of the
pages in ``PAGES`` between ``<!-- run by tests/test_readme.py: begin -->`` and ``<!-- run
by tests/test_readme.py: end -->`` (the README's examples that moved there with their
outputs), so this test follows whatever they say today. What it expects of those blocks
(and says, failing, where one is not met):

* every fenced block names its language: ``sh`` (commands, run as a bash script, stopped
  at the first that fails), ``python`` (run by the launch command of its first line) or
  ``text`` (output, layouts, trees: not run);
* a ``python`` block's first line is a comment holding its launch command, which names
  the file the block is saved as: ``# mpiexec -n 4 python -m mpi4py allreduce_demo.py``;
* a block that cannot run here (it needs root, a cluster, or half an hour) has
  ``<!-- not run: REASON -->`` on the line before its fence;
* a ``text`` block with ``<!-- expected output -->`` on the line before its fence is the
  output of the nearest run block above it: every line of it that starts with a word
  (letters and dashes, an optional colon: ``ring``, ``optcc``, ``DEGRADED:``, ``#``)
  must start a line of what that block printed, so that a renamed row or a changed
  verdict shows; numbers, which depend on the machine, are not compared.

Each block runs in a fresh temporary folder with this environment's ``bin`` first on
``PATH`` (``python``, ``mpiexec``, ``torchrun``, ``optcc-mpi`` are this checkout's),
without any launcher's or ``OPTCC_*`` variables, under a time limit. On this 2-core
machine all of them take about two minutes.

The README itself, for a reader with five minutes: at most ``MAX_WORDS`` words (as ``wc
-w`` counts them), the quick start (``make install``, ``make demo``, ``make test``) and
the PyTorch adoption (``dist.init_process_group("optcc")`` under DDP) on its first screen
(``FIRST_SCREEN`` lines), and every relative link to a file, and heading, that exists.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Pages with sections of blocks that run as the README's do (marked by BEGIN and END).
PAGES = ("docs/torch.md", "docs/doctor.md")
BEGIN = "<!-- run by tests/test_readme.py: begin -->"
END = "<!-- run by tests/test_readme.py: end -->"
MAX_WORDS = 2000
FIRST_SCREEN = 40
LANGUAGES = ("sh", "python", "text")
NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")
EXPECTED = "<!-- expected output -->"
FENCE = re.compile(r"^```(\S*)\s*$")
#: A line of expected output that starts with a word is compared by that word.
WORD = re.compile(r"^(#|[A-Za-z][A-Za-z-]*:?)(\s|$)")


@dataclass
class Block:
    """One fenced block of the README (or of a marked section of a page)."""

    page: str
    """Its file, relative to the repository root."""
    line: int
    """Line of its opening fence (1-based)."""
    lang: str
    code: str
    skip: str | None = None
    """Why it is not run (from ``<!-- not run: ... -->``)."""
    expected: bool = False
    """Whether ``<!-- expected output -->`` precedes it."""
    expected_of: int | None = None
    """For expected output: the line of the run block it is the output of."""

    @property
    def runs(self) -> bool:
        return self.lang in ("sh", "python") and self.skip is None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(text: str, page: str = "README.md") -> list[Block]:
    """Every fenced block of ``text``, in order, with what the comments before it say."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    last_run: int | None = None
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        before = lines[start - 1].strip() if start else ""
        skip = NOT_RUN.match(before)
        block = Block(page, start + 1, lang, "\n".join(lines[start + 1 : j]) + "\n")
        block.skip = skip.group(1) if skip else None
        if before == EXPECTED:
            block.expected, block.expected_of = True, last_run
        if block.runs:
            last_run = block.line
        out.append(block)
        i = j + 1
    return out


def marked(text: str, page: str) -> str:
    """``text`` with every line outside its sections marked BEGIN ... END blanked (the
    line numbers stay those of the page)."""
    out: list[str] = []
    inside = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip() in (BEGIN, END):
            opens = line.strip() == BEGIN
            assert opens != inside, f"{page}:{n}: {line.strip()} out of turn"
            inside = opens
            line = ""
        out.append(line if inside else "")
    assert not inside, f"{page}: {BEGIN} without {END}"
    return "\n".join(out)


ALL = blocks(README.read_text()) + [
    b for page in PAGES for b in blocks(marked((ROOT / page).read_text(), page), page)
]
RUN = [b for b in ALL if b.runs]


def test_every_block_says_what_it_is() -> None:
    """Languages from the list, launch commands on python blocks, reasons for what is
    not run, expected output after something that runs."""
    for b in ALL:
        assert b.lang in LANGUAGES, f"{b.where}: fence without one of {LANGUAGES}"
        if b.lang == "python":
            first = b.code.splitlines()[0] if b.code.strip() else ""
            assert first.startswith("# ") and re.search(r"\S+\.py\b", first), (
                f"{b.where}: a python block starts with its launch command, e.g. '# python demo.py'"
            )
        if b.expected:
            assert b.lang == "text" and b.expected_of is not None, (
                f"{b.where}: expected output is a text block after a block that runs"
            )
    assert sum(b.expected for b in ALL if b.page == "README.md") >= 1
    assert sum(b.runs for b in ALL if b.page == "README.md") >= 4, (
        "the quick start and the code examples run"
    )
    for page in PAGES:
        assert any(b.runs for b in ALL if b.page == page), (
            f"{page}: no block runs between {BEGIN} and {END}"
        )
    # A page marked for this test is in PAGES, so that its blocks do not silently go unrun.
    for path in sorted((ROOT / "docs").rglob("*.md")):
        page = path.relative_to(ROOT).as_posix()
        assert page in PAGES or BEGIN not in path.read_text(), f"{page}: add it to PAGES"
    # What is not run is said in the test's output, so that nobody hides a block there.
    print("not run:", [(b.where, b.skip) for b in ALL if b.skip])


def test_readme_is_short() -> None:
    """A newcomer reads it in five minutes: the details are one link away, in docs/."""
    words = len(README.read_text().split())
    assert words <= MAX_WORDS, (
        f"README.md has {words} words (wc -w), more than {MAX_WORDS}: move expected outputs, "
        "tables and details to the docs page it links to (the blocks can run there, "
        f"between {BEGIN} and {END}; PAGES)"
    )


def test_first_screen_says_how_to_start() -> None:
    """The quick start and the PyTorch adoption come before anything else."""
    first = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN])
    needs = ("make install", "make demo", "make test", "import optcc_mpi.torch")
    for needed in (*needs, 'dist.init_process_group("optcc")', "DistributedDataParallel"):
        assert needed in first, f"README.md: {needed!r} not in its first {FIRST_SCREEN} lines"


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of Markdown ``text`` (lower case, punctuation
    but hyphens and underscores dropped, spaces as hyphens, ``-1``, ``-2`` on repeats)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.+?)\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(f"{slug}-{n}" if n else slug)
    return found


def test_readme_links_resolve() -> None:
    """Every relative link of the README names a file that exists, and a heading of it."""
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        assert target.is_file(), f"README.md links to {path}, which does not exist"
        if anchor:
            assert anchor in anchors(target.read_text()), (
                f"README.md links to {link}: {path or 'README.md'} has no such heading"
            )


def _env() -> dict[str, str]:
    from optcc_mpi.lab import launch

    env = {k: v for k, v in launch.clean_env().items() if not k.startswith("OPTCC_")}
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "")])
    env.update(MPIR_CVAR_CH4_PROGRESS_THROTTLE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _run(block: Block, where: Path) -> subprocess.CompletedProcess:
    if block.lang == "python":
        launch = block.code.splitlines()[0][2:].strip()
        name = next(w for w in shlex.split(launch) if w.endswith(".py"))
        (where / name).write_text(block.code)
        script = launch
    else:
        script = block.code
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=where,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", RUN, ids=[f"{b.page}-line{b.line}-{b.lang}" for b in RUN])
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    done = _run(block, tmp_path)
    shown = f"{block.where}:\n{block.code}\n--- stdout\n{done.stdout[-3000:]}"
    shown += f"\n--- stderr\n{done.stderr[-3000:]}"
    assert done.returncode == 0, shown
    printed = (done.stdout + done.stderr).splitlines()
    for expect in (b for b in ALL if b.page == block.page and b.expected_of == block.line):
        for line in expect.code.splitlines():
            m = WORD.match(line)
            if m and not any(p.startswith(m.group(1)) for p in printed):
                pytest.fail(
                    f"{expect.where}: the expected output has a line starting "
                    f"{m.group(1)!r} that the block above did not print\n{shown}"
                )
