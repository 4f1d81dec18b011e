"""Progress in a log: when stderr is not a terminal (nohup, Slurm, a pipe) every long command prints
plain lines: one per layer (a data-aware method's, calibrate-kv's), byte progress at most every
30 s plus the start and the end; no escape codes, no carriage returns. --json stays NDJSON."""

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantize import events
from quantize.cli import app
from quantize.events import LogEmitter, RichEmitter

MIN_TOKENS = 20  # the tiny DeepSeek-V3's router leaves some experts of layer 1 below this on 4 x 64 tokens
GPTQ = ["--method", "gptq", "--samples", "4", "--seq-len", "64", "--min-expert-tokens", str(MIN_TOKENS)]
RATE_ETA = r"(?P<rate>[\d.,]+ (?:layers/s|s/layer))  ETA (?P<eta>(?:\d+h)?(?:\d+m)?\d+s)"
LAYER = re.compile(rf"^\[(?P<stage>[\w-]+)\] (?P<done>\d+)/(?P<total>\d+) layers  (?P<pct>\d+)%  {RATE_ETA}  "
                   r"layer (?P<layer>\d+)(?P<tail>.*)$")
EXPERTS = re.compile(r"experts: (\d+) quantized, (\d+) at RTN \(too few routed tokens\)")


def _cli(*argv) -> subprocess.CompletedProcess:
    """The real command in its own process, stdout and stderr pipes (a log, not a terminal)."""
    return subprocess.run([sys.executable, "-m", "quantize.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=600)


def _plain(text: str) -> None:
    assert "\x1b" not in text and "\r" not in text, repr(text[:2000])


def _layers(config: Path) -> int:
    cfg = json.loads((config / "config.json").read_text())
    return cfg.get("text_config", cfg)["num_hidden_layers"]


def test_gptq_convert_logs_a_line_per_layer_with_its_experts(tiny, tmp_path):
    src, out = tiny("deepseek_v3"), tmp_path / "out"
    p = _cli("convert", src, out, *GPTQ)
    assert p.returncode == 0, p.stderr[-3000:]
    _plain(p.stdout + p.stderr)
    lines = p.stderr.splitlines()
    n = _layers(src)
    assert n == 3  # counted by hand: the tiny config's decoder layers (its MTP layer is not one)
    got = [m for m in map(LAYER.match, lines) if m]
    assert [(m["stage"], int(m["done"]), int(m["total"]), int(m["layer"])) for m in got] == \
        [("gptq", i + 1, n, i) for i in range(n)]
    assert [int(m["pct"]) for m in got] == [round(100 * (i + 1) / n) for i in range(n)]
    # the experts each line names, against an independent count from the manifest: the routed token
    # counts below --min-expert-tokens, and the experts none of whose weights the report lists as RTN
    layers = json.loads((out / "quantize_manifest.json").read_text())["method"]["layers"]
    assert [r["layer"] for r in layers] == list(range(n))
    seen = {"quantized": 0, "rtn": 0}
    for m, r in zip(got, layers):
        tpe = r.get("tokens_per_expert")
        e = EXPERTS.search(m["tail"])
        if not tpe:
            assert e is None, m.string
            continue
        counts = [c for cs in tpe["counts"].values() for c in cs]
        starved = sum(c < MIN_TOKENS for c in counts)
        named = {x.group(1) for f in r["fallbacks"] if "--min-expert-tokens" in f["reason"]
                 for x in [re.search(r"experts\.(\d+)\.", f["name"])]}
        fell = {re.search(r"experts\.(\d+)\.", f["name"]).group(1) for f in r["fallbacks"] if ".experts." in f["name"]}
        assert e is not None, m.string
        assert (int(e.group(1)), int(e.group(2))) == (len(counts) - len(fell), starved), m.string
        assert len(named) == starved
        seen["quantized"] += int(e.group(1))
        seen["rtn"] += int(e.group(2))
    assert seen["quantized"] > 0 and seen["rtn"] > 0, seen  # both kinds occur: the counts are tested, not zeros
    # each starved weight is a warning line of its own; then convert's start and end by bytes
    rtn_lines = [x for x in lines if x.startswith("[gptq] warning: ") and "--min-expert-tokens" in x]
    assert len(rtn_lines) == sum(1 for r in layers for f in r["fallbacks"] if "--min-expert-tokens" in f["reason"])
    start = next(i for i, x in enumerate(lines) if x.startswith("[convert] start: "))
    assert start > max(lines.index(m.string) for m in got)  # the layer pass comes first
    done = [x for x in lines if x.startswith("[convert] done: ")]
    assert len(done) == 1 and re.search(r"100% in \d+s \([\d.,]+ (?:[KMG]i)?B/s\)$", done[0]), done
    assert all(x.startswith("[") for x in lines), lines  # nothing but our lines on stderr


def test_calibrate_kv_logs_a_line_per_layer(tiny):
    model = tiny("llama", layout="bf16")
    p = _cli("calibrate-kv", model, "--samples", "2", "--seq-len", "16")
    assert p.returncode == 0, p.stderr[-3000:]
    _plain(p.stdout + p.stderr)
    n = _layers(model)
    assert n == 2  # the tiny llama's config, by hand
    got = [m for m in map(LAYER.match, p.stderr.splitlines()) if m]
    assert [(m["stage"], int(m["done"]), int(m["total"]), int(m["layer"])) for m in got] == \
        [("calibrate-kv", i + 1, n, i) for i in range(n)]
    assert p.stderr.splitlines()[0] == f"[calibrate-kv] start: {n} layers"
    assert p.stderr.splitlines()[-1].startswith(f"[calibrate-kv] done: {n}/{n} layers  100% in ")


def test_json_is_ndjson_only(tiny, tmp_path):
    p = _cli("convert", tiny("deepseek_v3"), tmp_path / "out", *GPTQ, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    evs = [json.loads(x) for x in p.stdout.splitlines()]  # every line one JSON object
    assert all(isinstance(e, dict) and "event" in e for e in evs)
    layers = [e for e in evs if e["event"] == "layer"]
    assert [(e["layer"], e["of"]) for e in layers] == [(0, 3), (1, 3), (2, 3)]
    assert [e["stage"] for e in evs if e["event"] == "start"] == ["gptq", "convert"]
    assert not [x for x in p.stderr.splitlines() if x.startswith("[")], p.stderr  # no log lines beside it


def _rtn(tiny, tmp_path, monkeypatch, interval: float):
    monkeypatch.setattr(events, "LOG_INTERVAL_S", interval)
    res = CliRunner().invoke(app, ["convert", str(tiny("glm_moe_dsa")), str(tmp_path / f"o{interval}")])
    assert res.exit_code == 0, res.output
    _plain(res.stderr)
    return res.stderr.splitlines()


def test_rtn_convert_through_the_cli_is_throttled(tiny, tmp_path, monkeypatch):
    """CliRunner's stderr is not a terminal: the log emitter. A window no run reaches gives the start,
    the shards and the end only; a zero window a line per tensor (as many as --json's tensor events)."""
    quiet = _rtn(tiny, tmp_path, monkeypatch, 1e9)
    assert quiet[0].startswith("[convert] start: ") and quiet[-1].startswith("[convert] done: ")
    assert all(re.match(r"\[convert\] wrote \S+\.safetensors  ", x) for x in quiet[1:-1]), quiet
    every = _rtn(tiny, tmp_path, monkeypatch, 0.0)
    progress = [x for x in every if re.match(r"\[convert\] [\d.,]+ (?:[KMG]i)?B / [\d.,]+ (?:[KMG]i)?B  \d+%  "
                                             r"[\d.,]+ (?:[KMG]i)?B/s  ETA \S+  ", x)]
    res = CliRunner().invoke(app, ["convert", str(tiny("glm_moe_dsa")), str(tmp_path / "json"), "--json"])
    tensors = [e for e in map(json.loads, res.stdout.splitlines()) if e["event"] == "tensor"]
    assert len(progress) == len(tensors) > 3


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Stream(io.StringIO):
    """Records whether every line was flushed as soon as it was written."""

    def __init__(self):
        super().__init__()
        self.unflushed = 0
        self.flushed_lines = 0

    def write(self, s):
        self.unflushed += s.count("\n")
        return super().write(s)

    def flush(self):
        self.flushed_lines += self.unflushed
        self.unflushed = 0
        super().flush()


def _emitter():
    clock, stream = Clock(), Stream()
    return LogEmitter(stream, clock=clock), clock, stream


def test_byte_progress_at_most_every_interval(monkeypatch):
    emit, clock, stream = _emitter()
    gib = 2**30
    emit({"event": "start", "stage": "convert", "total_bytes": 40 * gib, "done_bytes": 0})
    assert stream.getvalue().splitlines() == ["[convert] start: 40.00 GiB"]

    def at(t: float, done: float) -> list[str]:
        before = len(stream.getvalue().splitlines())
        clock.t = 1000.0 + t
        emit({"event": "tensor", "name": "model.layers.0.mlp.w", "done_bytes": int(done * gib)})
        return stream.getvalue().splitlines()[before:]

    assert at(1, 1) == [] and at(15, 2) == []
    assert at(29.9, 3) == []  # a near miss: inside the window
    assert at(30.0, 4) == ["[convert] 4.00 GiB / 40.00 GiB  10%  136.53 MiB/s  ETA 4m30s  model.layers.0.mlp.w"]
    assert at(45, 5) == [] and at(59.9, 6) == []  # the window restarts at the line just printed
    assert len(at(60.0, 8)) == 1
    monkeypatch.setattr(events, "LOG_INTERVAL_S", 5.0)  # read at each event: a test may shorten it
    assert at(64.9, 9) == [] and len(at(65.0, 10)) == 1
    clock.t = 1120.0
    emit({"event": "done"})
    assert stream.getvalue().splitlines()[-1] == "[convert] done: 10.00 GiB / 40.00 GiB  25% in 2m00s (85.33 MiB/s)"
    assert stream.unflushed == 0 and stream.flushed_lines == len(stream.getvalue().splitlines())


def test_layers_every_event_rate_and_eta():
    emit, clock, stream = _emitter()
    emit({"event": "start", "stage": "gptq", "unit": "layers", "total_bytes": 40, "done_bytes": 0})
    for i in range(12):
        clock.t += 15.0  # each layer 15 s: well inside the byte window, a line each all the same
        emit({"event": "layer", "layer": i, "of": 40, "method": "gptq", "units": 6, "loss_rtn": 2e-3, "loss": 1e-3,
              "seconds": 15.0, "fallbacks": 6, "fallbacks_starved": 6, "experts": 256, "experts_quantized": 254,
              "experts_rtn": 2})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 13
    assert lines[-1] == ("[gptq] 12/40 layers  30%  15.0 s/layer  ETA 7m00s  layer 11: 6 INT4 weights, loss RTN 0.002 "
                         "-> gptq 0.001, 15.0 s; experts: 254 quantized, 2 at RTN (too few routed tokens)")
    emit({"event": "layer", "layer": 12, "of": 40, "replayed": True})
    assert "layer 12: recorded by an interrupted run, replayed" in stream.getvalue().splitlines()[-1]
    emit({"event": "layer", "layer": 13, "of": 40, "units": 0})
    assert stream.getvalue().splitlines()[-1].endswith("layer 13: no INT4 weight here, carried through")


def test_warnings_and_errors_are_plain_lines():
    emit, clock, stream = _emitter()
    emit({"event": "warning", "message": "native kernels unavailable (\x1b[31mred\x1b[0m)\r\nsecond line"})
    emit({"event": "start", "stage": "shard", "total_bytes": 2**20, "done_bytes": 0})
    clock.t += 75
    emit({"event": "error", "message": "no space left\n"})
    lines = stream.getvalue().splitlines()
    _plain(stream.getvalue())
    assert lines[0].startswith("[quantize] warning: native kernels unavailable (") and "second line" in lines[0]
    assert lines[-1] == "[shard] stopped at 0 B / 1.00 MiB  0% after 1m15s (the error follows)"
    assert len(lines) == 3


def test_a_terminal_keeps_the_rich_bar(monkeypatch):
    from quantize import cli

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    assert isinstance(cli._emitter(False), RichEmitter)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(cli._emitter(False), LogEmitter)
    assert isinstance(cli._emitter(True), events.JsonEmitter)


@pytest.mark.parametrize("t", [29.9, 30.0])
def test_the_window_edge(t):
    emit, clock, stream = _emitter()
    emit({"event": "start", "stage": "check", "unit": "modules", "total_bytes": 10, "done_bytes": 0})
    clock.t += t
    emit({"event": "tensor", "name": "m", "done_bytes": 5})
    assert len(stream.getvalue().splitlines()) == (1 if t < 30 else 2)


def test_converts_last_line_gives_a_rate_that_never_reads_zero():
    """The rate on convert's last line: GB/s down to 0.0005 (printed 0.001 at worst), MB/s below it (a
    small model on a slow machine: it was left out, and the walkthrough's excerpt lost its rate), nothing
    without a measured time. The oracle is the arithmetic: bytes / seconds / 1e9 or / 1e6."""
    from quantize.cli import _rate

    assert _rate(8_022_816 / 3.8 / 1e9) == " (0.002 GB/s)"
    assert _rate(0.0005) == " (0.001 GB/s)"
    assert _rate(0.000499) == " (0.499 MB/s)"  # the near miss below the edge
    assert _rate(8_022_816 / 60 / 1e9) == " (0.134 MB/s)"
    assert _rate(0.0) == ""
