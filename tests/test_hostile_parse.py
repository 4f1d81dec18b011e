"""Hostile input, the parsers: JSON and YAML of any depth, encoding, alias expansion or size are
one line naming the file (quantize.parse)."""

import pytest

from tests.hostile import Case, edit_json, run_case

DEEP = "[" * 100_000 + "]" * 100_000
LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
)


def _write(rel: str, data, where: str = "src"):
    def setup(ctx):
        p = getattr(ctx, where) / rel
        p.write_bytes(data if isinstance(data, bytes) else data.encode())

    return setup


def _recipe(text):
    def setup(ctx):
        (ctx.tmp / "r.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())

    return setup


CASES = [
    Case("plan: deep config.json", lambda c: ["plan", c.src], "nests deeper than 64 levels",
         _write("config.json", '{"a": ' + DEEP + "}")),
    Case("plan: config.json not UTF-8", lambda c: ["plan", c.src], "not UTF-8", _write("config.json", b"\xff\xfe{}")),
    Case("convert: deep index", lambda c: ["convert", c.src, c.new("o")], "nests deeper than 64 levels",
         _write("model.safetensors.index.json", '{"weight_map": ' + DEEP + "}")),
    Case("check: deep manifest", lambda c: ["check", c.out], "nests deeper", _write("quantize_manifest.json", DEEP, "out"),
         needs=("out",), code=2),
    Case("run: recursive recipe alias", lambda c: ["run", c.tmp / "r.yaml"], "refers to itself",
         _recipe("pipeline: &a [*a]\n"), needs=()),
    Case("run: billion laughs recipe", lambda c: ["run", c.tmp / "r.yaml"], "values", _recipe(LAUGHS), needs=()),
    Case("run: non-UTF-8 recipe", lambda c: ["run", c.tmp / "r.yaml"], "not UTF-8", _recipe(b"pipeline: \xff\n"),
         needs=()),
    Case("run: recipe is a folder", lambda c: ["run", c.tmp], "is a folder", needs=()),
    Case("convert: deep recipe", lambda c: ["convert", c.src, c.new("o"), "--recipe", c.tmp / "r.yaml"],
         "nests deeper", _recipe("[" * 5000 + "]" * 5000)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_hostile(case, tmp_path, hostile_sources):
    run_case(case, tmp_path, hostile_sources)


USAGE = [
    Case("convert: --group-size abc", lambda c: ["convert", c.src, c.new("o"), "--group-size", "abc"],
         "quantize convert: Invalid value for '--group-size'"),
    Case("shard: --tp 1e999", lambda c: ["shard", c.out, c.new("s"), "--tp", "1e999"], "Invalid value for '--tp'",
         needs=("out",)),
    Case("convert: missing argument", lambda c: ["convert"], "Missing argument", needs=()),
    Case("convert: unknown option", lambda c: ["convert", c.src, c.new("o"), "--bogus"], "No such option: --bogus"),
    Case("unknown command", lambda c: ["nosuch"], "No such command 'nosuch'", needs=()),
]


@pytest.mark.parametrize("case", USAGE, ids=str)
def test_usage_errors_are_one_line_too(case, tmp_path, hostile_sources):
    """What click refuses before our code runs (a value of the wrong type, an unknown option or
    command, a missing argument) is one line naming the command, not a usage box."""
    assert "--help" in run_case(case, tmp_path, hostile_sources)


def test_help_still_exits_0():
    from typer.testing import CliRunner

    from quantize.cli import app

    res = CliRunner().invoke(app, ["convert", "--help"])
    assert res.exit_code == 0 and "--group-size" in res.stdout
