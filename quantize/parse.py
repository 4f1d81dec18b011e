"""Bounded parsers: every JSON or YAML document this tool reads from a user's disk (config.json,
indexes, safetensors headers, manifests, job records, reports, recipes) comes through here, so a
hostile file costs one line naming it, never a traceback or minutes of CPU.

The bounds: a size (per kind of file, ``MAX_BYTES``), UTF-8 text, a nesting depth of ``MAX_DEPTH``
and, for YAML, a safe loader (no Python objects) that counts aliases and refuses a document that
expands past ``MAX_NODES`` nodes or refers to itself ("billion laughs", ``a: &a [*a]``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import QuantizeError

MAX_DEPTH = 64  # config.json, indexes, manifests and recipes nest a handful of levels
MAX_NODES = 200_000  # values in one document once YAML aliases are expanded
MAX_ALIASES = 100  # YAML alias uses in one recipe
MAX_BYTES = {
    "config": 16 << 20,
    "index": 256 << 20,  # a 1T-parameter MoE's index is ~10 MB
    "header": 100 << 20,  # the safetensors format's own limit
    "record": 256 << 20,  # manifests and job records list every file and its stats
    "report": 64 << 20,
    "recipe": 1 << 20,
}


def _too_deep(obj, limit: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> str | None:
    """Why ``obj`` is out of bounds (too deep, too many values, or refers to itself), else None;
    iterative, so the check itself cannot overflow the stack."""
    stack = [(obj, 1, ())]
    nodes = 0
    while stack:
        v, depth, path = stack.pop()
        if not isinstance(v, (dict, list)):
            nodes += 1
            if nodes > max_nodes:
                return f"holds more than {max_nodes:,} values"
            continue
        if depth > limit:
            return f"nests deeper than {limit} levels"
        if id(v) in path:
            return "refers to itself (a recursive alias)"
        nodes += 1
        if nodes > max_nodes:
            return f"holds more than {max_nodes:,} values (aliases expanded)"
        inner = path + (id(v),)
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1, inner) for c in children)
    return None


def _read(path: Path, kind: str, what: str) -> str:
    limit = MAX_BYTES[kind]
    if path.is_dir():
        raise QuantizeError(f"{path}: is a folder; pass the {what} itself")
    if path.exists() and not path.is_file():  # a FIFO or device would block or never end
        raise QuantizeError(f"{path}: not a regular file; pass the {what} itself")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise QuantizeError(
                    f"{path}: {size:,} bytes, more than the {limit:,} a {what} may have; it is not a {what}, fix it"
                )
            raw = f.read(limit + 1)
    except FileNotFoundError:
        raise QuantizeError(f"{path}: missing; pass an existing {what} file") from None
    except OSError as e:
        raise QuantizeError(f"{path}: cannot read ({e.strerror})") from e
    return decode(raw, path, what)


def decode(raw: bytes, path, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QuantizeError(f"{path}: not UTF-8 text (byte {e.start}); it is not a {what}, fix or replace it") from e


def json_text(text: str, path, what: str):
    """``text`` parsed as JSON within the bounds; one line naming ``path`` otherwise."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise QuantizeError(f"{path}: nests deeper than {MAX_DEPTH} levels; it is not a {what}, fix it") from None
    except json.JSONDecodeError as e:
        raise QuantizeError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); fix the {what}") from e
    except ValueError as e:  # an integer of more than 4300 digits (Python's int conversion limit)
        raise QuantizeError(f"{path}: {e}; it is not a {what}, fix it") from None
    why = _too_deep(obj)
    if why:
        raise QuantizeError(f"{path}: {why}; it is not a {what}, fix it")
    return obj


def load_json(path: str | os.PathLike, what: str = "JSON file", kind: str = "config", want: type | None = dict):
    """The JSON document at ``path``: at most ``MAX_BYTES[kind]``, UTF-8, ``MAX_DEPTH`` deep, and
    of type ``want`` (an object, by default) unless ``want`` is None."""
    path = Path(path)
    obj = json_text(_read(path, kind, what), path, what)
    if want is not None and not isinstance(obj, want):
        raise QuantizeError(f"{path}: a {what} must be a JSON {_json_name(want)}, not {_json_name(type(obj))}; fix it")
    return obj


def _json_name(tp: type) -> str:
    return {dict: "object", list: "array", str: "string", int: "number", float: "number"}.get(tp, tp.__name__)


def load_yaml(path: str | os.PathLike, what: str = "recipe"):
    """The YAML document at ``path`` through a safe loader with alias, depth, node and size bounds."""
    path = Path(path)
    return yaml_text(_read(path, "recipe", what), path, what)


def yaml_text(text: str, path, what: str = "recipe"):
    """``text`` (from ``path``, e.g. a card's front matter) parsed as YAML within the bounds."""
    import yaml

    if len(text.encode()) > MAX_BYTES["recipe"]:
        raise QuantizeError(f"{path}: more than {MAX_BYTES['recipe']:,} bytes of YAML; it is not a {what}, fix it")

    class Loader(yaml.SafeLoader):
        aliases = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                Loader.aliases += 1
                if Loader.aliases > MAX_ALIASES:
                    raise QuantizeError(
                        f"{path}: more than {MAX_ALIASES} YAML aliases (*name); write the values out, fix the {what}"
                    )
            if len(self.anchors) > MAX_ALIASES:
                raise QuantizeError(f"{path}: more than {MAX_ALIASES} YAML anchors (&name); fix the {what}")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise QuantizeError(
                        f"{path}: key {key!r} appears twice in one mapping (line {key_node.start_mark.line + 1}); "
                        f"YAML would keep only the last, fix the {what}"
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    try:
        doc = yaml.load(text, Loader=Loader)  # noqa: S506 - Loader is a SafeLoader
    except RecursionError:
        raise QuantizeError(f"{path}: nests deeper than {MAX_DEPTH} levels; fix the {what}") from None
    except yaml.YAMLError as e:
        raise QuantizeError(f"{path}: not valid YAML ({str(e).splitlines()[0]}); fix the {what}") from e
    except (ValueError, OverflowError) as e:  # an integer of more than 4300 digits, a float past the range
        raise QuantizeError(f"{path}: {e}; fix the {what}") from None
    why = _too_deep(doc)
    if why:
        raise QuantizeError(f"{path}: {why}; fix the {what}")
    return doc
