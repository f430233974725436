"""YAML nodes to the frozen dataclasses of ``agent.policy.model``, driven by the classes themselves.

Every YAML key is a dataclass field of the same name; the annotation says the type and the field's
metadata the unit (see ``agent.policy.model``). The walk runs over ``yaml.compose`` nodes rather
than plain Python values so that every value still knows its line. Nothing stops at the first
error: each problem is recorded with its line and the walk goes on with the field's default, so
one ``policy check`` shows them all.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable
from typing import Any

import yaml

from agent import units

NO_VALUE: Any = object()   # a field whose YAML value was bad: the default stands in
MAX_NODES = 200_000        # values in one policy; an alias bomb stops here


class PolicyTooLarge(Exception):
    """The policy expands to more values than any fleet needs (aliases nested on aliases)."""


class ComposeError(Exception):
    """The file is not YAML (or not UTF-8); ``line`` is 1-based, 0 for the file as a whole."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line


def compose(raw: bytes) -> yaml.Node | None:
    """The YAML nodes of ``raw`` (every value keeps its line); None for an empty file."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ComposeError(0, f"not UTF-8 text ({e.reason} at byte {e.start})") from e
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        what = " ".join(p for p in (e.context, e.problem) if p)
        if "'\\t'" in what:
            what += " (indent with spaces, not tabs)"
        if e.context_mark and mark and e.context_mark.line != mark.line:
            what += f" (the construct starts at line {e.context_mark.line + 1})"
        raise ComposeError(mark.line + 1 if mark else 0, f"YAML syntax error: {what}") from e
    except yaml.YAMLError as e:
        raise ComposeError(0, f"YAML error: {e}") from e


class Builder:
    """Holds the file name, the issues found and the line of every key path seen."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.issues: list[tuple[str, int, str]] = []
        self.lines: dict[str, int] = {}   # "backoff.floor" -> 42; "models[1]" -> 17
        self.bad: set[str] = set()         # key paths whose value was refused
        self.visited = 0
        self._constructor = yaml.constructor.SafeConstructor()

    def error(self, line: int, message: str) -> None:
        self.issues.append((self.file, line, message))

    def line_of(self, path: str, fallback: int = 1) -> int:
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path.rpartition(".")[0]
        return fallback

    def build(self, cls: type, node: yaml.Node, path: str,
              fixed: dict[str, Any] | None = None) -> Any:
        """An instance of dataclass ``cls`` from a mapping node (defaults where values are bad).

        ``fixed``: values that don't come from the mapping's keys (a role's name is its key).
        """
        line = _line(node)
        if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null"):
            node = yaml.MappingNode("tag:yaml.org,2002:map", [], node.start_mark, node.end_mark)
        if not isinstance(node, yaml.MappingNode):
            what = f"{path}: expected" if path else "the policy must be"
            self.error(line, f"{what} a mapping of keys, got {_kind(node)}")
            return NO_VALUE
        fields = {f.name: f for f in dataclasses.fields(cls)
                  if f.init and f.metadata.get("yaml", True) and not f.metadata.get("key")}
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = dict(fixed or {})
        seen: dict[str, int] = {}
        for key, key_line, value_node in self._pairs(node, path):
            if key.startswith("x-"):
                continue                  # extension keys: a place for anchors, ignored
            seen[key] = key_line
            if key not in fields:
                self.error(key_line, _unknown(key, path, fields))
                continue
            sub = _join(path, key)
            self.lines[sub] = key_line
            value = self.value(value_node, hints[key], fields[key].metadata, sub)
            if value is NO_VALUE:
                self.bad.add(sub)
            else:
                kwargs[key] = value
        for name, f in fields.items():
            if (name not in seen and f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING):
                self.error(line, f"{_where(path)}missing key {name!r}")
                return NO_VALUE
            if name in seen and name not in kwargs and f.default is dataclasses.MISSING \
                    and f.default_factory is dataclasses.MISSING:
                return NO_VALUE                      # a required value was bad; already said
        return cls(**kwargs)

    def _pairs(self, node: yaml.MappingNode, path: str) -> list[tuple[str, int, yaml.Node]]:
        """(key, line, value) of a mapping, YAML merge keys (``<<: *defaults``) resolved: a key
        given twice is an error, a key given once overrides what a merge brought in."""
        own = {id(k) for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"}
        copy = yaml.MappingNode(node.tag, list(node.value), node.start_mark, node.end_mark)
        try:
            self._constructor.flatten_mapping(copy)
        except yaml.constructor.ConstructorError as e:
            mark = e.problem_mark or e.context_mark
            self.error(mark.line + 1 if mark else _line(node), f"{_where(path)}bad merge key "
                                                               f"(<<): {e.problem}")
            return []
        out: dict[str, tuple[int, yaml.Node, bool]] = {}
        for key_node, value_node in copy.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            key_line = _line(key_node)
            if not isinstance(key, str) or not key:
                self.error(key_line, f"{_where(path)}a key must be a plain word")
                continue
            explicit = id(key_node) in own
            if key in out and explicit and out[key][2]:
                self.error(key_line, f"duplicate key {_join(path, key)!r} (first at line "
                                     f"{out[key][0]}); keep one")
                continue
            out[key] = (key_line, value_node, explicit)   # later wins: merged keys come first
        return [(k, line, v) for k, (line, v, _) in out.items()]

    def value(self, node: yaml.Node, hint: Any, meta: typing.Mapping[str, Any], path: str) -> Any:
        """The Python value of ``node`` for a field annotated ``hint``."""
        self.visited += 1
        if self.visited > MAX_NODES:
            raise PolicyTooLarge(f"more than {MAX_NODES} values (an alias expanding too far?)")
        line = _line(node)
        optional, hint = _strip_optional(hint)
        if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null"):
            if optional:
                return None
            self.error(line, f"{path} needs a value (it can't be empty or null)")
            return NO_VALUE
        origin = typing.get_origin(hint)
        if dataclasses.is_dataclass(hint):
            return self.build(hint, node, path)
        if origin is tuple:
            return self._tuple(node, typing.get_args(hint), meta, path)
        if not isinstance(node, yaml.ScalarNode):
            self.error(line, f"{path} expected {_describe(hint, meta)}, got {_kind(node)}")
            return NO_VALUE
        return self._scalar(node, hint, meta, path)

    def _tuple(self, node: yaml.Node, args: tuple[Any, ...], meta: typing.Mapping[str, Any],
               path: str) -> Any:
        item = args[0]
        key_field = _key_field(item)
        if key_field is not None:                     # roles: name -> body
            return self._keyed(node, item, key_field, path)
        if meta.get("unit") == "port_range":
            items = node.value if isinstance(node, yaml.SequenceNode) else [node]
            out = [self._port_range(n, path) for n in items]
            return NO_VALUE if NO_VALUE in out else tuple(out)
        if typing.get_origin(item) is tuple and isinstance(node, yaml.MappingNode):
            # pairs written as a mapping, e.g. roots: {proc: /x/proc, sys: /x/sys}
            pairs = [(self._text(k, path), self._text(v, f"{path}.{k.value}"))
                     for k, v in node.value]
            return NO_VALUE if any(NO_VALUE in p for p in pairs) else tuple(pairs)
        if isinstance(node, yaml.MappingNode) or (
                isinstance(node, yaml.ScalarNode) and dataclasses.is_dataclass(item)):
            self.error(_line(node), f"{path} expected a list, got {_kind(node)}")
            return NO_VALUE
        items = node.value if isinstance(node, yaml.SequenceNode) else [node]  # one item: a list
        out = []
        for i, child in enumerate(items):
            sub = f"{path}[{i}]"
            self.lines[sub] = _line(child)
            out.append(self.value(child, item, meta, sub))
        return NO_VALUE if NO_VALUE in out else tuple(out)

    def _keyed(self, node: yaml.Node, cls: type, key_field: str, path: str) -> Any:
        if not isinstance(node, yaml.MappingNode):
            self.error(_line(node), f"{path} expected a mapping of name: settings, got "
                                    f"{_kind(node)}")
            return NO_VALUE
        out, seen = [], {}
        for key_node, body in node.value:
            name = self._text(key_node, path)
            if name is NO_VALUE:
                continue
            if name in seen:
                self.error(_line(key_node), f"duplicate {path} entry {name!r} (first at line "
                                            f"{seen[name]})")
                continue
            seen[name] = _line(key_node)
            sub = f"{path}.{name}"
            self.lines[sub] = _line(key_node)
            built = self.build(cls, body, sub, fixed={key_field: name})
            if built is NO_VALUE:
                self.bad.add(sub)
            else:
                out.append(built)
        return tuple(out)

    def _scalar(self, node: yaml.ScalarNode, hint: Any, meta: typing.Mapping[str, Any],
                path: str) -> Any:
        line = _line(node)
        raw = self._constructor.construct_object(node, deep=True)
        unit = meta.get("unit")
        if unit in _PARSERS:
            parse, _ = _PARSERS[unit]
            try:
                value = parse(raw)
            except units.UnitError as e:
                self.error(line, f"{path}: {e}")
                return NO_VALUE
        elif unit == "port":
            value = self._port(raw, line, path)
        elif hint is bool:
            if not isinstance(raw, bool):
                self.error(line, f"{path} expected true or false, got {node.value!r}")
                return NO_VALUE
            value = raw
        elif hint is int:
            if isinstance(raw, bool) or not isinstance(raw, int):
                self.error(line, f"{path} expected a whole number, got {node.value!r}")
                return NO_VALUE
            value = raw
        elif hint is float:
            if isinstance(raw, bool) or not isinstance(raw, int | float):
                self.error(line, f"{path} expected a number, got {node.value!r}")
                return NO_VALUE
            value = float(raw)
        elif hint is str:
            value = self._text(node, path)      # then its choices, if any
        else:
            self.error(line, f"{path}: no loader for type {hint!r} (a wagent bug)")
            return NO_VALUE
        if value is NO_VALUE:
            return value
        return self._bounds(value, meta, line, path)

    def _bounds(self, value: Any, meta: typing.Mapping[str, Any], line: int, path: str) -> Any:
        if isinstance(value, units.Share):
            return value                    # within (0, 100%] by its parser; min/max are rates
        fmt = _PARSERS[meta["unit"]][1] if meta.get("unit") in _PARSERS else str
        low, high = meta.get("min"), meta.get("max")
        if (low is not None and value < low) or (high is not None and value > high):
            if low is not None and high is not None:
                want = f"between {fmt(low)} and {fmt(high)}"
            else:
                want = f"at least {fmt(low)}" if low is not None else f"at most {fmt(high)}"
            self.error(line, f"{path} is {fmt(value)}; it must be {want}")
            return NO_VALUE
        choices = meta.get("choices")
        if choices and value not in choices:
            self.error(line, f"{path} is {value!r}; choose one of {', '.join(map(str, choices))}")
            return NO_VALUE
        return value

    def _text(self, node: yaml.Node, path: str) -> Any:
        # Plain scalars keep their text: a version "2024.06" or "20240601" is a name, not a
        # number, so YAML's guess at a type is ignored for text fields.
        if isinstance(node, yaml.ScalarNode) and not node.tag.endswith((":null", ":bool")):
            return node.value
        self.error(_line(node), f"{path} expected text, got {_kind(node)}")
        return NO_VALUE

    def _port(self, raw: Any, line: int, path: str) -> Any:
        if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= 65535:
            self.error(line, f"{path}: {raw!r} is not a port; expected a number 1-65535")
            return NO_VALUE
        return raw

    def _port_range(self, node: yaml.Node, path: str) -> Any:
        line = _line(node)
        raw = (self._constructor.construct_object(node, deep=True)
               if isinstance(node, yaml.ScalarNode) else None)
        forms = "a port (29500) or an inclusive range in quotes (\"40000-40100\")"
        if isinstance(raw, int) and not isinstance(raw, bool):
            low = high = raw
        elif isinstance(raw, str) and raw.count("-") == 1 and all(
                p.strip().isdigit() for p in raw.split("-")):
            low, high = (int(p) for p in raw.split("-"))
        else:
            shown = repr(node.value) if isinstance(node, yaml.ScalarNode) else _kind(node)
            self.error(line, f"{path}: {shown} is not a port range; expected {forms}")
            return NO_VALUE
        if not (1 <= low <= high <= 65535):
            self.error(line, f"{path}: {low}-{high} is not a port range within 1-65535 "
                             f"(low end first)")
            return NO_VALUE
        return (low, high)


_PARSERS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], str]]] = {
    "rate": (units.parse_rate, units.format_rate),
    "rate_share": (units.parse_rate_or_share, units.format_rate),
    "size": (units.parse_size, units.format_size),
    "duration": (units.parse_duration, lambda s: units.format_duration(s) if s >= 1 else
                 f"{s * 1000:g}ms"),
}


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _where(path: str) -> str:
    return f"{path}: " if path else ""


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if node.tag.endswith(":null"):
        return "nothing (null)"
    return repr(node.value)


def _unknown(key: str, path: str, fields: dict[str, Any]) -> str:
    where = f" in {path}" if path else ""
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(fields)}"
    return f"unknown key {key!r}{where}{hint}"


def _strip_optional(hint: Any) -> tuple[bool, Any]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        every = typing.get_args(hint)
        args = [a for a in every if a is not type(None)]
        if len(args) == 1:
            return True, args[0]
        if len(args) < len(every):          # e.g. int | Share | None: the unit's parser decides
            return True, typing.Union[tuple(args)]
    return False, hint


def _key_field(item: Any) -> str | None:
    if dataclasses.is_dataclass(item):
        for f in dataclasses.fields(item):
            if f.metadata.get("key"):
                return f.name
    return None


def _describe(hint: Any, meta: typing.Mapping[str, Any]) -> str:
    unit = meta.get("unit")
    if unit:
        return f"a {unit.replace('_', ' ')}"
    return {bool: "true or false", int: "a whole number", float: "a number",
            str: "text"}.get(hint, str(hint))
