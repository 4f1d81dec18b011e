"""Strict validation of everything read before a byte is converted: safetensors headers (the
format's own rules), model.safetensors.index.json, the config.json fields we read and recipes; and
Hugging Face cache snapshots (symlinks into the cache's blobs/) as sources.

Every corrupt input is refused with one line naming the file (and tensor), before anything is written."""

import hashlib
import json
import os
import re
import shutil
import struct

import pytest

from quantize.checkpoint.index import CheckpointIndex
from quantize.convert import convert
from quantize.errors import QuantizeError
from quantize.recipe import load_recipe

from .conftest import dir_bytes

SHARD = "model-00001-of-00003.safetensors"


@pytest.fixture
def src(tiny, tmp_path):
    d = tmp_path / "src"
    shutil.copytree(tiny("glm_moe_dsa"), d)
    return d


def _split(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path, header, data, raw_header: bytes | None = None):
    hb = json.dumps(header).encode() if raw_header is None else raw_header
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def _by_offset(header):
    """Tensor names of a header, in data order."""
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def _refused(src, tmp_path, match, *names):
    """convert refuses with one line naming ``names``, before writing any weights."""
    out = tmp_path / "out"
    with pytest.raises(QuantizeError) as e:
        convert(src, out)
    msg = str(e.value)
    assert "\n" not in msg
    assert re.search(match, msg.replace(str(tmp_path), "")), msg  # tmp_path holds the test's name
    for n in names:
        assert n in msg, msg
    assert not (out.exists() and list(out.rglob("*.safetensors")))
    assert not (out / "config.json").exists()
    return msg


def _edit_shard(src, fn):
    """fn(header, data) -> (header, data) or (header, data, raw_header), rewritten into SHARD."""
    path = src / SHARD
    header, data = _split(path)
    _write(path, *fn(header, data))


# --------------------------------------------------------------------------------------- headers
def test_header_must_start_with_brace(src, tmp_path):
    def fn(h, d):
        return h, d, b"  " + json.dumps(h).encode()

    _edit_shard(src, fn)
    _refused(src, tmp_path, "must start with", SHARD)


@pytest.mark.parametrize("meta", [{"format": 1}, ["pt"], "pt", {"format": None}])
def test_metadata_must_map_strings_to_strings(src, tmp_path, meta):
    def fn(h, d):
        h["__metadata__"] = meta
        return h, d

    _edit_shard(src, fn)
    _refused(src, tmp_path, "__metadata__", SHARD)


@pytest.mark.parametrize("case", ["list", "extra_key", "no_shape", "no_offsets", "no_dtype"])
def test_tensor_entry_must_be_dtype_shape_offsets(src, tmp_path, case):
    name = None

    def fn(h, d):
        nonlocal name
        name = _by_offset(h)[1]
        info = h[name]
        if case == "list":
            h[name] = [info["dtype"], info["shape"], info["data_offsets"]]
        elif case == "extra_key":
            info["offset"] = 0
        else:
            del info[{"no_shape": "shape", "no_offsets": "data_offsets", "no_dtype": "dtype"}[case]]
        return h, d

    _edit_shard(src, fn)
    _refused(src, tmp_path, "dtype, shape and data_offsets", SHARD, name)


@pytest.mark.parametrize("dtype", [["F32"], 4, None, "F33"])
def test_dtype_must_be_a_known_string(src, tmp_path, dtype):
    name = None

    def fn(h, d):
        nonlocal name
        name = _by_offset(h)[0]
        h[name]["dtype"] = dtype
        return h, d

    _edit_shard(src, fn)
    _refused(src, tmp_path, "not a safetensors dtype", SHARD, name)


def test_shape_must_be_a_list(src, tmp_path):
    name = None

    def fn(h, d):
        nonlocal name
        name = next(k for k in _by_offset(h) if len(h[k]["shape"]) == 1)
        h[name]["shape"] = h[name]["shape"][0]
        return h, d

    _edit_shard(src, fn)
    _refused(src, tmp_path, "shape", SHARD, name)


def test_shape_must_not_be_negative(src, tmp_path):
    """[-a, -b] has the same product as [a, b]: only the sign check catches it."""
    name = None

    def fn(h, d):
        nonlocal name
        name = next(k for k in _by_offset(h) if len(h[k]["shape"]) == 2)
        h[name]["shape"] = [-x for x in h[name]["shape"]]
        return h, d

    _edit_shard(src, fn)
    _refused(src, tmp_path, "non-negative", SHARD, name)


@pytest.mark.parametrize("kind", ["float", "str", "bool"])
def test_shape_entries_must_be_ints(src, tmp_path, kind):
    name = None

    def fn(h, d):
        nonlocal name
        if kind == "bool":
            name = next(k for k in _by_offset(h) if 1 in h[k]["shape"])
            h[name]["shape"] = [True if x == 1 else x for x in h[name]["shape"]]
        else:
            name = _by_offset(h)[0]
            h[name]["shape"] = [float(x) if kind == "float" else str(x) for x in h[name]["shape"]]
        return h, d

    _edit_shard(src, fn)
    _refused(src, tmp_path, "shape", SHARD, name)


@pytest.mark.parametrize("kind", ["three", "one", "strings", "floats", "string", "negative", "reversed"])
def test_data_offsets_must_be_two_ordered_ints(src, tmp_path, kind):
    name = None

    def fn(h, d):
        nonlocal name
        name = _by_offset(h)[1]
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = {
            "three": [b, e, e],
            "one": [b],
            "strings": [str(b), str(e)],
            "floats": [float(b), float(e)],
            "string": f"{b}-{e}",
            "negative": [-(e - b), 0],
            "reversed": [e, b],
        }[kind]
        return h, d

    _edit_shard(src, fn)
    _refused(src, tmp_path, "data_offsets", SHARD, name)


def test_overlapping_tensors_refused(src, tmp_path):
    """The second tensor moved one byte back: sizes still match its shape, but it overlaps the first."""
    name = None

    def fn(h, d):
        nonlocal name
        name = _by_offset(h)[1]
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = [b - 1, e - 1]
        return h, d

    _edit_shard(src, fn)
    _refused(src, tmp_path, "overlaps", SHARD, name)


def test_gap_between_tensors_refused(src, tmp_path):
    name = None

    def fn(h, d):
        nonlocal name
        order = _by_offset(h)
        name = order[1]
        cut = h[order[0]]["data_offsets"][1]
        for k in order[1:]:
            h[k]["data_offsets"] = [x + 8 for x in h[k]["data_offsets"]]
        return h, d[:cut] + bytes(8) + d[cut:]

    _edit_shard(src, fn)
    _refused(src, tmp_path, "gap", SHARD, name)


def test_first_tensor_must_begin_at_zero(src, tmp_path):
    name = None

    def fn(h, d):
        nonlocal name
        order = _by_offset(h)
        name = order[0]
        for k in order:
            h[k]["data_offsets"] = [x + 8 for x in h[k]["data_offsets"]]
        return h, bytes(8) + d

    _edit_shard(src, fn)
    _refused(src, tmp_path, "gap", SHARD, name)


def test_trailing_bytes_refused(src, tmp_path):
    _edit_shard(src, lambda h, d: (h, d + bytes(16)))
    _refused(src, tmp_path, "trailing", SHARD)


def test_truncated_shard_still_named(src, tmp_path):
    f = src / SHARD
    f.write_bytes(f.read_bytes()[:-1])
    _refused(src, tmp_path, "truncated", SHARD)


# ----------------------------------------------------------------------------------------- index
def _edit_json(path, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("kind", ["list", "int_value", "null_value"])
def test_index_weight_map_must_map_names_to_files(src, tmp_path, kind):
    def fn(idx):
        wm = idx["weight_map"]
        if kind == "list":
            idx["weight_map"] = sorted(set(wm.values()))
        else:
            wm[next(iter(wm))] = 1 if kind == "int_value" else None

    _edit_json(src / "model.safetensors.index.json", fn)
    _refused(src, tmp_path, "weight_map", "model.safetensors.index.json")


def test_index_metadata_must_be_an_object(src, tmp_path):
    _edit_json(src / "model.safetensors.index.json", lambda idx: idx.__setitem__("metadata", [1]))
    _refused(src, tmp_path, "metadata", "model.safetensors.index.json")


# ---------------------------------------------------------------------------------------- config
def test_config_architectures_must_be_a_list(src, tmp_path):
    _edit_json(src / "config.json", lambda c: c.__setitem__("architectures", c["architectures"][0]))
    _refused(src, tmp_path, "architectures", "config.json")


def test_config_quantization_config_must_be_an_object(src, tmp_path):
    _edit_json(src / "config.json", lambda c: c.__setitem__("quantization_config", [c["quantization_config"]]))
    _refused(src, tmp_path, "quantization_config", "config.json")


@pytest.mark.parametrize("block", [[128], [128, 0], [128, -128], [128, "128"], [128.0, 128], [True, 128], "128x128"])
def test_config_weight_block_size_must_be_two_positive_ints(src, tmp_path, block):
    _edit_json(src / "config.json", lambda c: c["quantization_config"].__setitem__("weight_block_size", block))
    _refused(src, tmp_path, "weight_block_size", "config.json")


def test_text_config_quantization_config_validated(tiny, tmp_path):
    """Kimi nests the language model's config in text_config; its quantization_config is checked too."""
    d = tmp_path / "kimi"
    shutil.copytree(tiny("kimi_k25"), d)

    def fn(c):
        qc = c.pop("quantization_config")
        qc["weight_block_size"] = [0, 128]
        c["text_config"]["quantization_config"] = qc

    _edit_json(d / "config.json", fn)
    msg = _refused(d, tmp_path, "weight_block_size", "config.json")
    assert "text_config" in msg


# --------------------------------------------------------------------------------------- recipes
def _recipe(tmp_path, ignore="['lm_head']", group="32", targets='["Linear"]'):
    f = tmp_path / "r.yaml"
    f.write_text(f"""quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: {ignore}
      config_groups:
        group_0:
          targets: {targets}
          weights: {{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: {group}}}
""")
    return f


def _recipe_refused(f, match):
    with pytest.raises(QuantizeError) as e:
        load_recipe(f)
    msg = str(e.value)
    assert str(f) in msg and "\n" not in msg
    assert re.search(match, msg.replace(str(f.parent), "")), msg
    return msg


@pytest.mark.parametrize("ignore", ["lm_head", "[1]", "[['lm_head']]", "{a: b}"])
def test_recipe_ignore_must_be_a_list_of_strings(tmp_path, ignore):
    _recipe_refused(_recipe(tmp_path, ignore=ignore), "ignore")


def test_recipe_ignore_regex_must_compile(tmp_path):
    msg = _recipe_refused(_recipe(tmp_path, ignore="['lm_head', 're:.*(mlp']"), "does not compile")
    assert "re:.*(mlp" in msg and "missing )" in msg


@pytest.mark.parametrize("group", ["'32'", "32.0", "true", "null"])
def test_recipe_group_size_must_be_an_int(tmp_path, group):
    _recipe_refused(_recipe(tmp_path, group=group), "group_size .* must be an integer")


@pytest.mark.parametrize("targets", ["Linear", "[1]"])
def test_recipe_targets_must_be_a_list_of_strings(tmp_path, targets):
    _recipe_refused(_recipe(tmp_path, targets=targets), "targets")


def test_recipe_valid_still_loads(tmp_path):
    r = load_recipe(_recipe(tmp_path, ignore="['lm_head', 're:.*mlp\\.gate$']"))
    assert r.ignore == ("lm_head", "re:.*mlp\\.gate$") and r.group_size == 32 and r.targets == ("Linear",)


# ------------------------------------------------------------------------- Hugging Face cache
REV = "0123456789abcdef0123456789abcdef01234567"


def _hf_cache(plain, root):
    """The layout `hf download` (no --local-dir) leaves: blobs/<sha256> plus snapshots/<rev>/<name>
    relative symlinks into ../../blobs."""
    repo = root / "hub" / "models--x--y"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    for p in sorted(plain.iterdir()):
        if p.is_file():
            data = p.read_bytes()
            sha = hashlib.sha256(data).hexdigest()
            (repo / "blobs" / sha).write_bytes(data)
            (snap / p.name).symlink_to(f"../../blobs/{sha}")
    return snap


def test_hf_cache_snapshot_converts_like_the_plain_folder(tiny, converted, tmp_path):
    plain = tiny("glm_moe_dsa")
    snap = _hf_cache(plain, tmp_path)
    assert (snap / SHARD).is_symlink()
    idx = CheckpointIndex.open(snap)
    assert idx.revision == REV
    out = tmp_path / "out"
    convert(snap, out)
    a, b = dir_bytes(out), dir_bytes(converted("glm_moe_dsa"))
    a.pop("quantize_manifest.json"), b.pop("quantize_manifest.json")
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]


def test_revision_of_local_dir_download_and_plain_folder(src):
    assert CheckpointIndex.open(src).revision is None
    meta = src / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    (meta / f"{SHARD}.metadata").write_text(f"{REV}\n{'e' * 64}\n1700000000.0\n")
    assert CheckpointIndex.open(src).revision == REV


@pytest.mark.parametrize("where", ["outside", "other_cache_repo", "cache_root"])
def test_hf_cache_symlink_leaving_the_cache_refused(tiny, tmp_path, where):
    plain = tiny("glm_moe_dsa")
    snap = _hf_cache(plain, tmp_path)
    link = snap / SHARD
    if where == "outside":
        target = tmp_path / "evil.safetensors"
    elif where == "other_cache_repo":
        target = tmp_path / "hub" / "models--a--b" / "blobs" / ("f" * 64)
    else:
        target = tmp_path / "hub" / "evil.safetensors"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plain / SHARD, target)
    link.unlink()
    link.symlink_to(os.path.relpath(target, snap))
    msg = _refused(snap, tmp_path, "points outside", SHARD)
    assert str(target) in msg


def test_plain_folder_symlink_leaving_it_refused(src, tmp_path):
    target = tmp_path / "evil.safetensors"
    shutil.move(src / SHARD, target)
    (src / SHARD).symlink_to(target)
    _refused(src, tmp_path, "points outside", SHARD)


def test_dangling_symlink_refused(tiny, tmp_path):
    snap = _hf_cache(tiny("glm_moe_dsa"), tmp_path)
    os.unlink(os.path.realpath(snap / SHARD))
    _refused(snap, tmp_path, "dangling symlink", SHARD)
