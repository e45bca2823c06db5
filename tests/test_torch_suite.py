"""torch's own distributed test suite on the ``optcc`` backend (tests/torch_suite.py).

The CI selection (``torch_suite.CI_TESTS``) at 2 and 3 ranks, on gloo and on optcc: every
test that passes on gloo passes on optcc unless docs/torch.md lists it, and every listed
test still fails there. The whole selection runs with ``make test-torch-suite``
(docs/results.md has its last result). Also, without starting any process: the list in
docs/torch.md and the comparison itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))

import torch_suite  # noqa: E402


def _run(outcome: str, message: str = "") -> dict:
    return {"outcome": outcome, "seconds": 1.0, "message": message}


def test_known_differences_are_read_from_the_docs() -> None:
    """Each listed difference has its reason and is in the CI selection, so that CI keeps
    the whole list true."""
    known = torch_suite.known_differences()
    assert "test_get_backend" in known
    for name, reason in known.items():
        assert name in torch_suite.CI_TESTS, name
        assert len(reason) > 20, (name, reason)


def test_known_differences_need_the_section(tmp_path: Path) -> None:
    doc = tmp_path / "torch.md"
    doc.write_text("# PyTorch\n\n| `test_get_backend` | not in the section |\n")
    with pytest.raises(ValueError, match="no section"):
        torch_suite.known_differences(doc)
    doc.write_text(f"{torch_suite.KNOWN_SECTION}\n\nno table\n\n## Next\n")
    with pytest.raises(ValueError, match="lists no test"):
        torch_suite.known_differences(doc)
    doc.write_text(
        f"{torch_suite.KNOWN_SECTION}\n\n| test | why |\n|---|---|\n"
        "| `test_a` | reason a |\n\n## Next\n\n| `test_b` | another section |\n"
    )
    assert torch_suite.known_differences(doc) == {"test_a": "reason a"}


def test_compare_finds_regressions_and_stale_listings() -> None:
    gloo = {n: _run("passed") for n in ("t_ok", "t_regress", "t_known", "t_stale")}
    gloo["t_gloo_fails"] = _run("failed", "x")
    gloo["t_skip"] = _run("skipped")
    optcc = {
        "t_ok": _run("passed"),
        "t_regress": _run("failed", "Traceback\nRuntimeError: boom\n"),
        "t_known": _run("failed"),
        "t_stale": _run("passed"),
        "t_gloo_fails": _run("passed"),
        "t_skip": _run("skipped"),
    }
    known = {"t_known": "by design", "t_stale": "was by design"}
    diff = torch_suite.compare(gloo, optcc, known)
    assert diff == {
        "regressions": ["t_regress"],
        "stale": ["t_stale"],
        "known": ["t_known"],
        "gloo_only_fail": ["t_gloo_fails"],
    }
    text, ok = torch_suite.report({2: {"gloo": (gloo, 3.0), "optcc": (optcc, 4.0)}}, known)
    assert not ok
    assert "REGRESSION t_regress" in text and "RuntimeError: boom" in text
    assert "STALE t_stale" in text
    _, ok = torch_suite.report({2: {"gloo": (gloo, 3.0), "optcc": (gloo, 3.0)}}, {})
    assert ok


def test_short_message_names_the_exception() -> None:
    message = (
        "Traceback (most recent call last):\n  File 'x', line 1\n"
        "ValueError: inner\n\nProcess 0 exited with error code 10 and exception:\n"
        "Traceback\n  File 'y'\nRuntimeError: the last one\n\n"
    )
    assert torch_suite.short(message) == "RuntimeError: the last one"
    assert torch_suite.short("no exception here\n") == "no exception here"


@pytest.mark.timeout(300)
def test_selection_names_tests_of_torchs_suite() -> None:
    """The CI selection and the listed differences are tests of the installed torch's suite
    and of the selection, and the selection is not empty (a torch that renamed them
    fails here, not silently)."""
    selected = torch_suite.list_tests()
    assert len(selected) > 100
    assert set(torch_suite.CI_TESTS) <= set(selected)
    assert set(torch_suite.known_differences()) <= set(selected)


# Each test's ranks are stopped after torch_suite.TEST_TIMEOUT, each worker after 400 s.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks", [pytest.param(n, marks=pytest.mark.slow) for n in (2, 3)])
def test_ci_selection_passes_on_optcc_where_it_passes_on_gloo(ranks: int) -> None:
    names = list(torch_suite.CI_TESTS)
    known = torch_suite.known_differences()
    runs = {ranks: {b: torch_suite.run_config(b, ranks, names, 400) for b in ("gloo", "optcc")}}
    text, ok = torch_suite.report(runs, known)
    # The comparison means something only if gloo passes the whole selection.
    assert all(r["outcome"] == torch_suite.PASSED for r in runs[ranks]["gloo"][0].values()), text
    assert ok, text
