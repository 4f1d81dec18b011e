"""scripts/gpu_node_proof.sh never runs here (no GPU): every quantize command in it must be one the
CLI has, with options the command takes, so that the script a user runs on an 8xH200 node is not
a stub that fails at its first line."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import typer

from quantize.cli import app

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_node_proof.sh"


def _commands(script: Path = SCRIPT) -> list[list[str]]:
    text = script.read_text()
    arrays = {m.group(1): shlex.split(m.group(2)) for m in re.finditer(r"^\s*(\w+)=\((.*)\)\s*$", text, re.M)}
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.split(" #")[0].strip()
        line = re.sub(r'^\[.*\]\s*\|\|\s*', "", line)
        if not line.startswith("quantize "):
            continue
        words = []
        for w in shlex.split(line.split(" > ")[0]):
            m = re.fullmatch(r"\$\{(\w+)\[@\]\}", w)
            words += arrays.get(m.group(1), []) if m else [w]
        out.append(words)
    return out


def _options(cmd) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


def test_the_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def _unknown(script: Path) -> list[str]:
    cli = typer.main.get_command(app)
    bad = []
    for words in _commands(script):
        name = words[1]
        if name not in cli.commands:
            bad.append(f"quantize {name}: no such command")
            continue
        have = _options(cli.commands[name])
        bad += [f"quantize {name} has no {w}" for w in words[2:] if w.startswith("--") and w.split("=")[0] not in have]
    return bad


def test_every_command_and_option_in_the_gpu_script_exists():
    assert {c[1] for c in _commands()} >= {"plan", "convert", "check", "calibrate-kv", "eval", "card"}
    assert _unknown(SCRIPT) == []


def test_the_check_catches_an_unknown_option_or_command(tmp_path):
    """Near misses: the same check fails on the script with one option misspelt, or one command."""
    bad = tmp_path / "proof.sh"
    bad.write_text(SCRIPT.read_text().replace("--kld-top-k 100", "--kld-topk 100").replace("quantize card",
                                                                                          "quantize cards"))
    assert _unknown(bad) == ["quantize eval has no --kld-topk", "quantize cards: no such command"]
