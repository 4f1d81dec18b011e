"""quantize.startup: the CLI holds the garbage collector off while a command imports, then freezes
what exists and collects again; nothing changes in a process that did not hold."""

from __future__ import annotations

import gc
import importlib.util
import subprocess
import sys
import textwrap

import pytest

import quantize.startup as startup


def _py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_hold_then_settle_freezes_what_exists_and_collects_again():
    r = _py(
        """
        import gc
        import quantize.startup as s
        assert gc.isenabled() and gc.get_freeze_count() == 0
        s.hold()
        assert not gc.isenabled()
        junk = [[i] for i in range(5000)]  # tracked objects made while held
        n = len(gc.get_objects())
        assert s.settle() is True
        assert gc.isenabled()
        frozen = gc.get_freeze_count()
        assert frozen >= n - 50 and not gc.get_objects(), (frozen, n)  # all of them, none left to walk
        assert s.settle() is False and gc.get_freeze_count() == frozen  # once
        print("ok")
        """
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_settle_without_hold_changes_nothing():
    """A library caller's process (the tests, a user's script): settle is a no-op."""
    r = _py(
        """
        import gc
        import quantize.startup as s
        gc.disable()
        assert s.settle() is False
        assert not gc.isenabled() and gc.get_freeze_count() == 0
        gc.enable()
        assert s.settle() is False and gc.isenabled() and gc.get_freeze_count() == 0
        print("ok")
        """
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_a_hold_ends_after_its_limit_whatever_happens():
    r = _py(
        """
        import gc, time
        import quantize.startup as s
        s.hold(limit_s=0.3)
        time.sleep(0.05)
        assert not gc.isenabled()  # before the limit: still held
        deadline = time.time() + 20
        while not gc.isenabled() and time.time() < deadline:
            time.sleep(0.05)
        assert gc.isenabled() and gc.get_freeze_count() > 0
        assert s.settle() is False  # the timer settled
        print("ok")
        """
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (the triton extra)")
def test_frozen_objects_are_released_at_exit():
    """triton's nanobind bindings report any of their objects alive at teardown as a leak; a frozen
    one is, unless settle's exit hook unfreezes it. The near miss (the hook dropped) shows it."""
    code = """
        import atexit
        import quantize.startup as s
        {drop}
        s.hold()
        import triton
        assert s.settle()
        """
    good = _py(code.format(drop=""))
    assert good.returncode == 0 and "leaked" not in good.stderr, good.stderr
    bad = _py(code.format(drop="atexit.register = lambda f: f"))
    assert bad.returncode == 0 and "nanobind: leaked" in bad.stderr, bad.stderr


@pytest.fixture
def settles(monkeypatch):
    """Every call of startup.settle, by the function that made it (the real one still runs)."""
    calls: list[str] = []
    real = startup.settle

    def spy():
        calls.append(sys._getframe(1).f_code.co_name)
        return real()

    monkeypatch.setattr(startup, "settle", spy)
    return calls


def test_cli_convert_settles_once_compressed_tensors_is_in_not_before(tiny, tmp_path, settles):
    """convert's CLI call does not settle (``settle=False``): its RTN path imports compressed-tensors
    on a thread beside the first shards, and settles after that import (``_ct_config``)."""
    from typer.testing import CliRunner

    from quantize.cli import app

    res = CliRunner().invoke(app, ["convert", str(tiny("glm_moe_dsa")), str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert settles == ["_ct_config"]


def test_cli_other_commands_settle_before_their_library_call(tiny, settles):
    from typer.testing import CliRunner

    from quantize.cli import app

    res = CliRunner().invoke(app, ["plan", str(tiny("glm_moe_dsa"))])
    assert res.exit_code == 0, res.output
    assert settles == ["_run"]


def test_convert_in_a_held_process_ends_settled(tiny, tmp_path, monkeypatch):
    """The real state: held (as the CLI's main leaves it), convert turns the collector back on."""
    from quantize.convert import convert

    monkeypatch.setattr(startup, "_state", {"held": True, "settled": False})
    monkeypatch.setattr(startup, "_timer", [])
    gc.disable()
    try:
        convert(tiny("glm_moe_dsa"), tmp_path / "out")
        assert startup._state["settled"] and gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()
