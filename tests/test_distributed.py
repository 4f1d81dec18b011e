"""Several ranks, one run (quantize/distributed.py, docs/distributed.md): the fixed partition, the
rank-ordered collectives, a World of one that needs no process group, and failures in one line:
a rank that exits early fails the others within seconds, a hung rank within --dist-timeout-s, and
the --nproc launcher prints the first rank's error once, without torchrun's traceback. The ranks
are real processes under torchrun (gloo on the CPU)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from quantize import distributed as D
from quantize import options as O
from quantize.cli import app
from quantize.errors import PeerLost, QuantizeError

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in (*D.TORCHRUN_ENV, "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", D.LAUNCHED)}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(args: list[str], timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=_env(),
                       cwd=ROOT)
    return p, time.monotonic() - t


def _torchrun(logs: Path) -> list[str]:
    """The user's own torchrun: two ranks on this machine (its logs in the test's folder)."""
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(logs)]


SELFTEST = ["-m", "quantize.distributed", "selftest"]


# -- the partition ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 3, 7, 8, 10, 256, 257])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8, 9])
def test_the_partition_is_contiguous_balanced_and_owner_inverts_it(n, size):
    parts = [D.partition(n, size, r) for r in range(size)]
    assert [i for p in parts for i in p] == list(range(n))  # every item once, in rank order
    assert all(p.step == 1 for p in parts)
    lens = [len(p) for p in parts]
    assert max(lens) - min(lens) <= 1 and lens == sorted(lens, reverse=True)  # the longer blocks first
    for r, p in enumerate(parts):
        assert all(D.owner_of(i, n, size) == r for i in p)


def test_the_partition_of_ten_over_four():
    assert [list(D.partition(10, 4, r)) for r in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [list(D.partition(2, 4, r)) for r in range(4)] == [[0], [1], [], []]  # fewer items than ranks
    for bad in ((5, 0, 0), (5, 2, 2), (-1, 2, 0)):
        with pytest.raises(ValueError):
            D.partition(*bad)
    with pytest.raises(ValueError):
        D.owner_of(10, 10, 4)  # one past the last item


@pytest.mark.parametrize("n", [1, 4, 7, 8, 9, 10, 512])
@pytest.mark.parametrize("size", [1, 2, 3, 8, 9, 16])
def test_the_sample_split_is_whole_fixed_shards_in_rank_order(n, size):
    shards = D.sample_shards(n)
    assert len(shards) == min(n, D.SAMPLE_SHARDS)  # a function of n alone: never of the rank count
    assert [i for s in shards for i in s] == list(range(n))
    mine = [D.samples_of(n, size, r) for r in range(size)]
    assert [i for m in mine for i in m] == list(range(n))  # every sample once, rank order = sample order
    starts = {s.start for s in shards} | {n}
    assert all(m.start in starts and m.stop in starts for m in mine)  # whole shards only
    assert sum(1 for m in mine if len(m)) == min(size, len(shards))  # ranks past the last shard hold none


def test_the_sample_split_of_ten_over_two_and_nine_ranks():
    assert [len(s) for s in D.sample_shards(10)] == [2, 2, 1, 1, 1, 1, 1, 1]
    assert [list(D.samples_of(10, 2, r)) for r in range(2)] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert [len(D.samples_of(10, 9, r)) for r in range(9)] == [2, 2, 1, 1, 1, 1, 1, 1, 0]


class _Rank0:
    """Rank 0 of two, whose gathers return what rank 1 sent to each (``peer``: in call order)."""

    size, rank, is_writer = 2, 0, True

    def __init__(self, peer):
        self.peer = list(peer)

    def gather(self, obj, what, to=None):
        return [obj, self.peer.pop(0)]


class _Rank1(_Rank0):
    rank, is_writer = 1, False

    def __init__(self, peer=()):
        self.sent, self.peer = [], list(peer)

    def gather(self, obj, what, to=None):
        import copy

        self.sent.append(copy.deepcopy(obj))  # sent at the call, as torch.distributed pickles it
        return [self.peer.pop(0), obj] if to is None else None  # to every rank: rank 0's object, then its own


def _hooked(samples, terms, own):
    """A Hessians collector fed the per-sample terms of ``own`` (run-wide indices), as Forward merges them."""
    from quantize.methods.gptq import Hessians

    h = Hessians(None, [], False, samples)
    for s in own:
        h.merge({"H": {"u": terms[s].clone()}, "n": {"u": 1}, "tokens": {"u": 3}}, s)
    return h


def _terms(n, seed=0):
    """Per-sample terms whose sum depends on the order of additions (magnitudes 1e-6 to 1e5)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 16, generator=g) * 10.0 ** torch.randint(-6, 6, (1,), generator=g).item()
            for _ in range(n)]


@pytest.mark.parametrize("n", [4, 10, 19])
def test_hessians_split_over_two_ranks_are_one_process_bit_for_bit(n):
    """The shards' sums combined on rank 0 are one process's, bit for bit; rank 1 sends one
    subtree (the right half of the shards), not each shard."""
    import torch

    terms = _terms(n, n)
    one = _hooked(n, terms, range(n))
    one.combine(None, "test")
    h0 = _hooked(n, terms, D.samples_of(n, 2, 0))
    r1 = _Rank1([{"n": dict(h0.n), "tokens": dict(h0.tokens)}])
    h1 = _hooked(n, terms, D.samples_of(n, 2, 1))
    h1.combine(r1, "test")
    counts, stack = r1.sent
    assert not h1.H and len(stack) == 1 and stack[0][0] == (len(D.sample_shards(n)) // 2, len(D.sample_shards(n)))
    assert h1.n == one.n  # the divisors and token counts: on every rank (a unit's owner may be any of them)
    h0.combine(_Rank0(r1.sent), "test")
    assert torch.equal(h0.H["u"], one.H["u"]) and h0.n == one.n == {"u": n} and h0.tokens == {"u": 3 * n}
    flat = terms[0].clone()
    for t in terms[1:]:
        flat += t
    assert not torch.equal(flat, one.H["u"])  # the control: one left-to-right sum over samples is another number


@pytest.mark.parametrize("leaves", [1, 2, 5, 8])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 8, 9])
def test_a_tree_sum_is_the_same_for_any_split_of_its_leaves(leaves, size):
    """Each rank pushes its contiguous leaves and ends with its maximal subtrees; rank 0 pushes
    the others' in rank order: the root is one process's, bit for bit."""
    import torch

    vals = _terms(leaves, 100 + leaves)
    add = lambda a, b: a + b  # noqa: E731
    one = D.TreeSum(leaves, add)
    for j in range(leaves):
        one.leaf(j, vals[j].clone())
    want = one.combine(None, "test")
    ranks = []
    for r in range(size):
        t = D.TreeSum(leaves, add)
        for j in D.partition(leaves, size, r):
            t.leaf(j, vals[j].clone())
        ranks.append(t)
    for t in ranks[1:]:
        for node, v in t.stack:
            ranks[0].push(node, v)
    assert torch.equal(ranks[0].combine(None, "test"), want)
    if size in (2, 4, 8) and leaves == 8:  # ranks a power of two: one subtree each to send
        assert all(len(t.stack) == 1 for t in ranks[1:])


def test_a_tree_sum_refuses_a_gap_or_a_missing_leaf():
    t = D.TreeSum(4, lambda a, b: a + b)
    t.leaf(0, 1.0)
    t.leaf(1, 2.0)
    with pytest.raises(QuantizeError, match=r"shard sum: \(3, 4\) after \(0, 2\)"):
        t.leaf(3, 4.0)  # shard 2 missing: a rank that skipped one
    with pytest.raises(QuantizeError, match=r"cover \[\(0, 2\)\], not the 4 shards"):
        t.combine(None, "test")


def test_a_rank_that_cannot_see_the_recorded_layers_says_so_in_one_line(tmp_path):
    """A resumed GPTQ run's other ranks replay rank 0's layer files: on a node without them
    (OUT not on a shared disk), one line naming the file and the fix; with them, no complaint."""
    from quantize.methods.runner import LAYERS_DIR, rank_pass

    layers = tmp_path / ".quantize" / LAYERS_DIR
    layers.mkdir(parents=True)
    (layers / "0000.safetensors").write_bytes(b"x")
    job = {"out": str(tmp_path), "first": 2, "device": "cpu",
           "layers": {"0000": {"file": "0000.safetensors"}, "0001": {"file": None, "parts": [{"file": "0001-e00000.safetensors"}]}}}
    with pytest.raises(QuantizeError, match=r"rank 1: .*0001-e00000\.safetensors, a layer rank 0 recorded, is not visible "
                                            r"here \(or not of its recorded size\); a --resume whose ranks span nodes "
                                            r"needs OUT on a disk every node shares"):
        rank_pass(tmp_path / "src", job, SimpleNamespace(rank=1, device="cpu"))
    (layers / "0001-e00000.safetensors").write_bytes(b"xy")
    job["layers"]["0001"]["parts"][0]["bytes"] = 1  # a stale copy: another size than rank 0 recorded
    with pytest.raises(QuantizeError, match=r"0001-e00000\.safetensors, a layer rank 0 recorded, is not visible here"):
        rank_pass(tmp_path / "src", job, SimpleNamespace(rank=1, device="cpu"))
    job["layers"]["0001"]["parts"][0]["bytes"] = 2
    assert not (tmp_path / ".quantize" / "hidden" / "rank-1").exists()  # its spill folder, removed with the refusal
    with pytest.raises(KeyError):  # past the check: the (incomplete) job's pass itself
        rank_pass(tmp_path / "src", job, SimpleNamespace(rank=1, device="cpu"))


# -- a World of one -----------------------------------------------------------------------------


def test_a_world_of_one_needs_no_process_group(monkeypatch):
    import torch.distributed as dist

    for k in (*D.TORCHRUN_ENV, "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    with D.world(5) as w:
        assert (w.rank, w.size, w.device, w.is_writer, w.quiet) == (0, 1, "cpu", True, False)
        assert D.current() is w and not dist.is_initialized()
        assert D.gather({"a": 1}, "step") == [{"a": 1}] and D.gather(3, "step", to=0) == [3]
        assert D.broadcast("x", "step") == "x"
        D.barrier("step")
        assert list(D.owned(5)) == [0, 1, 2, 3, 4] and D.owner(4, 5) == 0
    assert D.current().size == 1


def _selftest_one(capsys, monkeypatch, items: int) -> dict:
    for k in (*D.TORCHRUN_ENV, "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    assert D._selftest(["--items", str(items)]) == 0
    return json.loads(capsys.readouterr().out)


def test_two_ranks_gather_in_rank_order_and_own_their_blocks(capsys, monkeypatch, tmp_path):
    one = _selftest_one(capsys, monkeypatch, 7)
    p, _ = _run([*_torchrun(tmp_path), *SELFTEST, "--items", "7"])
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert len(lines) == 1  # rank 0 alone prints
    two = json.loads(lines[0])
    assert (one["size"], one["ranks"], one["parts"]) == (1, [0], [list(range(7))])
    assert (two["size"], two["ranks"], two["parts"]) == (2, [0, 1], [[0, 1, 2, 3], [4, 5, 6]])
    assert [i for part in two["parts"] for i in part] == [i for part in one["parts"] for i in part]
    assert two["token"] == "from rank 0"  # broadcast from rank 0, whatever rank 1 held
    assert two["at_writer"] == [{"rank": 0, "owns": [0, 1, 2, 3]}, {"rank": 1, "owns": [4, 5, 6]}]
    assert (two["backend"], two["device"]) == ("gloo", "cpu")
    # tensors of every dtype and size, raw or pickled, all-gathered, gathered and broadcast: bit for bit, in
    # one span and in many through a staging buffer
    assert one["tensors"] == [[True, True]] and two["tensors"] == [[True, True], [True, True]]


# -- failures in one line -------------------------------------------------------------------------


def test_a_rank_that_exits_early_fails_the_other_within_seconds(tmp_path):
    """Rank 1 leaves without a word (exit 0, so torchrun does not stop rank 0 for it): rank 0's
    barrier fails at once (gloo sees the closed connection), far inside the 60 s timeout."""
    p, wall = _run(["-m", "quantize.distributed", "selftest", "--nproc", "2", "--vanish", "1", "--timeout-s", "60",
                    "--timings", str(tmp_path)], timeout=180)
    assert p.returncode == 2
    assert p.stderr.splitlines() == [
        "error: rank 0: rank 1 stopped during 'selftest barrier' (barrier), its connection closed: its own error, "
        "if it printed one, says why; rerun the command"
    ]
    waited = json.loads((tmp_path / "rank-0.json").read_text())["failed_after_s"]
    assert waited < 5, waited
    # the whole run ended before the 60 s timeout could have fired (3.6 s on a quiet 2-core host, 10.4 s in a
    # slow period: torch's start in three processes is most of it; docs/testing.md)
    assert wall < 60, wall


def test_a_hung_rank_fails_the_run_within_the_timeout(tmp_path):
    """Under the user's own torchrun: rank 1 hangs before the barrier; rank 0 says so in one line
    after --dist-timeout-s (5 s), and torchrun then stops the hung rank."""
    p, wall = _run([*_torchrun(tmp_path / "logs"), *SELFTEST, "--hang", "1", "--timeout-s", "5",
                    "--timings", str(tmp_path)], timeout=180)
    assert p.returncode != 0
    mine = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert mine == [
        "error: rank 0: rank 1 did not reach 'selftest barrier' (barrier) within 5 s (--dist-timeout-s): it hangs or "
        "stopped without a word; rerun the command"
    ]
    waited = json.loads((tmp_path / "rank-0.json").read_text())["failed_after_s"]
    assert 4.9 <= waited < 10, waited
    assert wall < 60, wall  # torchrun stopped the hung rank before its 110 s sleep ran out (8.6 s quiet, 18.8 s slow)
    assert "traceback : error: rank 0: rank 1 did not reach" in p.stderr  # torchrun's summary shows the line


def test_the_launcher_prints_the_first_ranks_error_once(tmp_path):
    """Rank 1 fails with a QuantizeError; rank 0 then fails at the barrier too (or is stopped by
    torchrun): the launcher prints rank 1's line, the root cause, once, and exits with its code."""
    p, wall = _run([*SELFTEST, "--nproc", "2", "--fail", "1", "--timeout-s", "60"], timeout=180)
    assert p.returncode == 2
    assert p.stderr == "error: rank 1: a planted failure (selftest --fail 1)\n"
    assert p.stdout == "" and wall < 60  # before rank 0's 60 s timeout (3.7 s quiet, 11.4 s in a slow period)


def test_nproc_runs_convert_as_ranks_that_refuse_a_method_they_do_not_split(tiny, tmp_path):
    """`quantize convert ... --nproc 2` runs under torchrun; RTN does not split
    their work across ranks: one line, exit 2, no traceback, no output."""
    p, _ = _run(["-m", "quantize.cli", "convert", str(tiny("deepseek_v3")), str(tmp_path / "out"), "--nproc", "2",
                 "--dist-timeout-s", "30"])
    assert p.returncode == 2
    errors = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "only the data-aware methods (gptq, autoround) split" in errors[0], p.stderr
    assert "Traceback" not in p.stdout + p.stderr and not (tmp_path / "out" / "quantize_manifest.json").exists()


# -- the options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["convert", "calibrate-kv"])
@pytest.mark.parametrize("flag,value,fragment", [
    ("--nproc", "0", "--nproc 0: must be from 1 to 1024 ranks on this machine"),
    ("--nproc", "1025", "--nproc 1025: must be from 1 to 1024"),
    ("--dist-timeout-s", "nan", "--dist-timeout-s nan: not a finite number; must be a positive number of seconds"),
    ("--dist-timeout-s", "0", "--dist-timeout-s 0.0: must be a positive number of seconds up to 604800 (a week)"),
    ("--dist-timeout-s", "604800.5", "--dist-timeout-s 604800.5: must be a positive number of seconds"),
])
def test_nproc_and_the_timeout_are_refused_in_one_line(tmp_path, monkeypatch, cmd, flag, value, fragment):
    launched = []
    monkeypatch.setattr(D, "launch", lambda *a, **k: launched.append(a) or 0)
    paths = [str(tmp_path / "src")] + ([str(tmp_path / "out")] if cmd == "convert" else [])
    res = CliRunner().invoke(app, [cmd, *paths, flag, value])
    assert res.exit_code == 2 and not launched
    lines = res.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {fragment}"), res.output


def test_the_edge_values_are_accepted():
    for v in (O.ConvertOptions(nproc=1, dist_timeout_s=1e-3), O.ConvertOptions(nproc=1024, dist_timeout_s=604800.0),
              O.CalibrateKVOptions(nproc=1024, dist_timeout_s=604800.0)):
        v.validate()


def test_nproc_and_the_timeout_change_no_record_and_are_no_recipe_keys():
    from quantize import pipeline

    for model, section in ((O.ConvertOptions, "convert"), (O.CalibrateKVOptions, "kv")):
        assert model(nproc=8, dist_timeout_s=5.0).to_dict() == model().to_dict()  # manifest and resume key
        assert {"nproc", "dist_timeout_s"}.isdisjoint(pipeline.SECTIONS[section].model_fields)
    assert O.ConvertOptions(nproc=8).key_dict() == O.ConvertOptions().key_dict()


def test_nproc_outside_torchrun_launches_the_same_command_line(tmp_path, monkeypatch):
    for k in (*D.TORCHRUN_ENV, "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    launched = []
    monkeypatch.setattr(D, "launch", lambda module, argv, nproc, **k: launched.append((module, argv, nproc)) or 3)
    argv = ["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--nproc", "4", "--dist-timeout-s", "9"]
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 3 and launched == [("quantize.cli", argv, 4)]  # the launcher's code is the exit code


def test_under_torchrun_a_different_nproc_is_refused(tmp_path, monkeypatch):
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}  # never reached: both refusals come before the process group
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = CliRunner().invoke(app, ["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--nproc", "3"])
    assert res.exit_code == 2 and res.output == (
        "error: --nproc 3 under torchrun, which started 2 rank(s) on this node; drop --nproc (torchrun's "
        "--nproc-per-node decides)\n")


def test_a_library_call_with_nproc_starts_no_ranks(tmp_path):
    from quantize.convert import convert

    with pytest.raises(QuantizeError, match=r"--nproc 2: this call runs in 1 process\(es\) here; the command line"):
        convert(tmp_path / "src", tmp_path / "out", nproc=2)
    assert not (tmp_path / "out").exists()


# -- the one line, from the pieces ------------------------------------------------------------------


class _Store:
    """The rendezvous store's part the failure message reads: each rank's last collective."""

    def __init__(self, steps: dict):
        self.steps = {f"{D._STEP}{r}": str(s) for r, s in steps.items()}

    def set(self, k, v):
        self.steps[k] = v

    def set_timeout(self, t):
        pass

    def check(self, keys):
        return all(k in self.steps for k in keys)

    def get(self, k):
        return self.steps[k].encode()


@pytest.mark.parametrize("error,expect", [
    ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5", "rank 2 stopped during 'layer 3' "
     "(gather), its connection closed"),
    ("Read error [127.0.0.1]:1177: Connection reset by peer", "rank 2 stopped during 'layer 3' (gather)"),
    ("[gloo/unbound_buffer.cc:129] Timed out waiting 5000ms for send operation to complete",
     "rank 2 did not reach 'layer 3' (gather) within 7 s (--dist-timeout-s)"),
    ("something else", "'layer 3' (gather) failed: something else"),
])
def test_a_failed_collective_names_the_rank_that_never_arrived(error, expect):
    """Of four ranks, rank 2 never entered the fourth collective (its last step is 3): rank 0's
    one line names it, whatever gloo said."""
    w = D.World(rank=0, size=4, backend="gloo", timeout_s=7, store=_Store({1: 4, 2: 3, 3: 4}))
    w._step = 3

    def op():
        raise RuntimeError(error)

    with pytest.raises(QuantizeError) as e:
        w._collective("gather", "layer 3", op)
    msg = str(e.value)
    assert msg.startswith("rank 0: ") and expect in msg and "\n" not in msg, msg
    assert msg.endswith("; rerun the command")


def test_without_the_store_the_peer_is_another_rank():
    class Gone(_Store):
        def check(self, keys):
            raise RuntimeError("store gone")

    w = D.World(rank=1, size=3, backend="gloo", store=Gone({}))
    with pytest.raises(PeerLost, match="rank 1: another rank stopped during 'x' "):
        w._collective("barrier", "x", lambda: (_ for _ in ()).throw(RuntimeError("Connection closed by peer")))
    w2 = D.World(rank=1, size=2, backend="gloo", store=Gone({}))  # of two, the other one
    with pytest.raises(QuantizeError, match="rank 1: rank 0 stopped during 'x' "):
        w2._collective("barrier", "x", lambda: (_ for _ in ()).throw(RuntimeError("Connection closed by peer")))


def _failure(exitcode, data=None, timestamp=100):
    return SimpleNamespace(exitcode=exitcode, error_file_data=data or {"message": "<NONE>"}, timestamp=timestamp)


@pytest.mark.parametrize("joined", [True, False])
def test_a_rank_that_joined_ends_without_the_interpreters_teardown(tmp_path, joined):
    """``end_process``: a process that joined a group of ranks exits with its code at once, its
    output flushed and no atexit handler run (the teardown where torch.distributed's threads can
    abort a finished rank); one that never joined returns and ends as usual."""
    code = (f"import atexit, sys\nfrom quantize import distributed as D\nD._JOINED = {joined}\n"
            "atexit.register(lambda: print('teardown', flush=True))\nprint('written')\n"
            "sys.stderr.write('said')\nD.end_process(3)\nprint('returned')\nsys.exit(5)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    if joined:
        assert (p.returncode, p.stdout, p.stderr) == (3, "written\n", "said")
    else:
        assert (p.returncode, p.stdout, p.stderr) == (5, "written\nreturned\nteardown\n", "said")


def test_a_peers_loss_is_reported_as_a_consequence(tmp_path, monkeypatch):
    """``report_error`` writes the rank's line into torchrun's error file, a ``PeerLost`` marked as a
    consequence (what the launcher ranks after a rank's own error), any other error not."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv(D.LAUNCHED, "1")
    for err, consequence in ((PeerLost("rank 0: rank 1 stopped"), True), (QuantizeError("rank 1: bad input"), False)):
        path = tmp_path / f"{consequence}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        D.report_error(err)
        q = json.loads(path.read_text())["quantize"]
        assert (q["line"], q["exit_code"], q["consequence"]) == (f"error: {err}", 2, consequence)


def test_the_launcher_shows_the_earliest_error_and_else_the_rank_that_died():
    said = lambda t, line, code: {"quantize": {"line": line, "time": t, "exit_code": code}}  # noqa: E731
    failures = {0: _failure(2, said(10.5, "error: rank 0: rank 1 stopped", 2)),
                1: _failure(-15, said(10.2, "error: rank 1: bad input", 2))}  # stopped by torchrun after saying it
    assert D._first_failure(failures) == ("error: rank 1: bad input", 2)
    # a peer's loss said first (clocks of two processes) gives way to the rank's own error said after it
    lost = {"quantize": {"line": "error: rank 0: rank 1 stopped", "time": 10.1, "exit_code": 2, "consequence": True}}
    failures[0] = _failure(2, lost)
    assert D._first_failure(failures) == ("error: rank 1: bad input", 2)
    assert D._first_failure({0: failures[0], 1: _failure(-15)}) == ("error: rank 0: rank 1 stopped", 2)  # only it
    stopped = -int(signal.SIGTERM)
    assert D._first_failure({0: _failure(stopped, timestamp=1), 1: _failure(-9, timestamp=2)}) == (
        "error: rank 1 was killed by SIGKILL (out of memory?); its output, if any, is above", 1)
    assert D._first_failure({0: _failure(stopped), 1: _failure(1)}) == (
        "error: rank 1 exited with code 1; its output is above", 1)


def test_a_rank_aware_command_runs_in_the_world_and_rank_0_alone_prints(monkeypatch, capsys):
    """Once a command splits its work (RANK_AWARE), each rank joins the World, runs the body and
    leaves it; a rank other than 0 prints nothing on stdout and its progress goes nowhere."""
    from quantize import cli
    from quantize.events import null_emit

    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(D, "RANK_AWARE", {"convert"})
    seen = []

    def join(timeout_s, backend):
        D._CURRENT = D.World(rank=int(os.environ["RANK"]), size=2, local_rank=1, local_size=2, backend="gloo",
                             timeout_s=timeout_s)
        seen.append(("join", timeout_s, backend))
        return D._CURRENT

    monkeypatch.setattr(D, "join", join)
    monkeypatch.setattr(D, "leave", lambda: seen.append("leave") or setattr(D, "_CURRENT", D.World()))

    def body(**kw):
        print("result")
        seen.append((D.current().rank, cli._emitter(False) is null_emit, kw["nproc"]))
        return "ok"

    kw = {"nproc": 2, "dist_timeout_s": 9.0}
    assert cli._ranks(O.ConvertOptions, "convert", body, kw) == "ok"
    # a CPU run meets on gloo even where a GPU is visible; --device cuda on NCCL (a GPU per rank)
    assert capsys.readouterr().out == "" and seen == [("join", 9.0, "gloo"), (1, True, 2), "leave"]
    monkeypatch.setenv("RANK", "0")
    seen.clear()
    assert cli._ranks(O.ConvertOptions, "convert", body, kw) == "ok"
    assert capsys.readouterr().out == "result\n" and seen == [("join", 9.0, "gloo"), (0, False, 2), "leave"]
    seen.clear()
    assert cli._ranks(O.ConvertOptions, "convert", body, {**kw, "device": "cuda"}) == "ok"
    assert seen[0] == ("join", 9.0, "nccl")
    seen.clear()
    assert cli._ranks(O.ConvertOptions, "convert", body, {**kw, "device": "cpu"}) == "ok"
    assert seen[0] == ("join", 9.0, "gloo")


def test_exchange_slices_hold_at_most_the_limit_and_one_item_at_least():
    from quantize.methods.streamed import exchange_slices

    assert exchange_slices([4, 4, 4, 4], 8) == [range(0, 2), range(2, 4)]
    assert exchange_slices([4, 4, 4, 4], 7) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]  # one byte short
    assert exchange_slices([9, 1, 1], 2) == [range(0, 1), range(1, 3)]  # an item over the limit travels alone
    assert exchange_slices([], 8) == []
    sizes = [3, 5, 2, 7, 1, 1, 6]
    cut = exchange_slices(sizes, 8)
    assert [k for r in cut for k in r] == list(range(len(sizes)))  # every item once, in order
    assert all(sum(sizes[k] for k in r) <= 8 for r in cut)


@pytest.mark.parametrize("to", [0, 1, 2])
def test_a_tree_sum_finished_on_any_rank_is_one_process_s(to):
    """The root on the rank the units' owner is (``combine(to=)``): every part pushed in rank order,
    the receiver's own where its rank falls, so one process's sum bit for bit; a receiver that put
    its own part first (as rank 0 may) gets another number, or a gap."""
    import torch

    vals = _terms(5, 7)
    add = lambda a, b: a + b  # noqa: E731
    one = D.TreeSum(5, add)
    for j in range(5):
        one.leaf(j, vals[j].clone())
    want = one.combine(None, "test")

    def ranks():
        out = []
        for r in range(3):
            t = D.TreeSum(5, add)
            for j in D.partition(5, 3, r):
                t.leaf(j, vals[j].clone())
            out.append(t)
        return out

    class W:
        size, rank = 3, to

        def __init__(self, parts):
            self.parts = parts

        def gather(self, obj, what, to=None):
            assert obj == [] and to == self.rank  # the receiver sends nothing
            return self.parts

    ts = ranks()
    parts = [[] if r == to else list(ts[r].stack) for r in range(3)]
    assert torch.equal(ts[to].combine(W(parts), "test", to=to), want)
    if to:
        ts = ranks()
        own = list(ts[to].stack)
        with pytest.raises(QuantizeError, match="shard sum"):
            ts[to].stack = []
            for part in [own] + [p for r, p in enumerate(parts) if r != to]:  # its own first: out of leaf order
                for node, v in part:
                    ts[to].push(node, v)


def test_balance_gives_the_costliest_first_to_the_least_loaded_rank():
    assert D.balance([1, 9, 4, 4], 2) == [1, 0, 1, 1]
    assert D.balance([1, 9, 4, 4], 1) == [0, 0, 0, 0]
    assert D.balance([5, 5], 2) == [0, 1] and D.balance([5, 5], 3) == [0, 1]  # ties: the lowest rank
    assert D.balance([], 4) == []
    assert D.balance([3, 3, 2, 2, 2], 2) == [0, 1, 0, 1, 0]  # 7 against 5: not a perfect split, but the same on every rank
