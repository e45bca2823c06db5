"""optcc_mpi.config: the OPTCC_* table read once into ``rc`` (typed, refusing unknown
names), and ``reload()`` for a process that changes its environment."""

from __future__ import annotations

import pytest

from optcc_mpi import config


def test_read_once_then_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTCC_LINKS", "1:0.5")
    config.reload()
    assert config.rc.links == "1:0.5" and config.get("OPTCC_LINKS") == "1:0.5"
    monkeypatch.setenv("OPTCC_LINKS", "2:0.25")
    assert config.rc.links == "1:0.5"  # read once: the process changed it behind our back
    config.reload()
    assert config.rc.links == "2:0.25"
    monkeypatch.setenv("OPTCC_LINKS", "   ")
    config.reload()
    assert config.rc.links is None and not config.is_set("OPTCC_LINKS")  # blank is unset


def test_typed_flags_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPTCC_FASTCALL", raising=False)
    monkeypatch.delenv("OPTCC_CUDA_AWARE", raising=False)
    config.reload()
    assert config.rc.fastcall is True  # default "1"
    assert config.rc.cuda_aware is None  # no default: detect
    monkeypatch.setenv("OPTCC_FASTCALL", "0")
    monkeypatch.setenv("OPTCC_CUDA_AWARE", "1")
    config.reload()
    assert config.rc.fastcall is False and config.rc.cuda_aware is True


def test_assignment_and_unknown_names() -> None:
    config.rc.links = "0:0.5"
    assert config.rc.links == "0:0.5" and config.get("OPTCC_LINKS") == "0:0.5"
    config.rc.fastcall = False
    assert config.rc.fastcall is False and config.get("OPTCC_FASTCALL") == "0"
    with pytest.raises(AttributeError, match="no setting 'linkz'.*links"):
        config.rc.linkz = "0:0.5"
    with pytest.raises(AttributeError, match="no setting 'linkz'"):
        _ = config.rc.linkz
    with pytest.raises(TypeError, match="takes a string"):
        config.rc.links = 0.5
    with pytest.raises(KeyError, match="OPTCC_NOPE"):
        config.get("OPTCC_NOPE")
    config.reload()  # assignments are dropped
    assert "linkz" not in dir(config.rc) and "links" in dir(config.rc)


def test_every_variable_is_an_attribute() -> None:
    for name, var in config.VARIABLES.items():
        assert var.attr == name.removeprefix("OPTCC_").lower()
        getattr(config.rc, var.attr)  # no AttributeError
        assert f"`{var.attr}`" in config.markdown()


def test_declared_types_follow_the_table() -> None:
    # rc's attributes are declared for the type checker only (config.Settings, under
    # TYPE_CHECKING): one per variable, a flag as bool | None, text as str | None. A
    # variable added to the table without its declaration, or with the wrong type, fails.
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(config.Settings))
    (cls,) = tree.body
    assert isinstance(cls, ast.ClassDef)
    declared = {
        node.target.id: ast.unparse(node.annotation)
        for block in cls.body
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in block.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    expected = {
        v.attr: "bool | None" if v.kind == "flag" else "str | None"
        for v in config.VARIABLES.values()
    }
    assert declared == expected
