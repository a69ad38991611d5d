"""Reading scenario YAML with line numbers, so every validation error names the field and its line.

PyYAML's composed node tree keeps a start mark for every node; we construct the plain Python value
from it and keep a map ``path -> line`` beside it. :class:`Fields` is a small typed accessor over one
mapping that raises :class:`ScenarioError` with ``<source>:<line>: <path>: <problem>``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

Path = tuple[str | int, ...]


class ScenarioError(ValueError):
    """A scenario that cannot be used; the message names the file, the line and the field."""


def path_str(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top>"


@dataclass(frozen=True)
class YamlDoc:
    """A parsed YAML document plus the line (1-based) of every key and item."""

    source: str
    data: Any
    lines: Mapping[Path, int]

    def line_of(self, path: Path) -> int | None:
        # Fall back to the closest enclosing node that has a line.
        for cut in range(len(path), -1, -1):
            line = self.lines.get(path[:cut])
            if line is not None:
                return line
        return None

    def error(self, path: Path, problem: str) -> ScenarioError:
        line = self.line_of(path)
        where = f"{self.source}:{line}" if line is not None else self.source
        return ScenarioError(f"{where}: {path_str(path)}: {problem}")

    def root(self) -> Fields:
        if not isinstance(self.data, dict):
            raise self.error((), f"a scenario must be a mapping of fields, got {_kind(self.data)}")
        return Fields(self, (), self.data)


def parse_yaml(text: str, source: str) -> YamlDoc:
    """Parse one YAML document; syntax errors become :class:`ScenarioError` with their line."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise ScenarioError(f"{source}: the file is empty")
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ScenarioError(f"{source}{line}: YAML syntax error: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{source}: YAML error: {exc}") from None
    finally:
        loader.dispose()
    lines: dict[Path, int] = {}
    _collect_lines(node, (), lines)
    return YamlDoc(source=source, data=data, lines=lines)


def _collect_lines(node: yaml.Node, path: Path, lines: dict[Path, int]) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = str(key_node.value)
            lines[(*path, key)] = key_node.start_mark.line + 1
            _collect_lines(value_node, (*path, key), lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _collect_lines(item, (*path, i), lines)


def _kind(value: object) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: "text", bool: "true/false"}.get(
        type(value), type(value).__name__
    )


@dataclass(frozen=True)
class Fields:
    """Typed access to one YAML mapping; every failure names the field and its line."""

    doc: YamlDoc
    path: Path
    data: dict[str, Any]

    def error(self, key: str | int | None, problem: str) -> ScenarioError:
        return self.doc.error(self.path if key is None else (*self.path, key), problem)

    def has(self, key: str) -> bool:
        return key in self.data

    def check_keys(self, allowed: set[str]) -> None:
        for key in self.data:
            if str(key) not in allowed:
                hint = difflib.get_close_matches(str(key), sorted(allowed), n=1)
                tip = f" (did you mean {hint[0]!r}?)" if hint else ""
                known = ", ".join(sorted(allowed))
                raise self.error(str(key), f"unknown field{tip}; known fields: {known}")

    def require(self, key: str) -> Any:
        if key not in self.data or self.data[key] is None:
            raise self.error(None, f"missing required field {key!r}")
        return self.data[key]

    def number(
        self,
        key: str,
        *,
        default: float | None = None,
        required: bool = False,
        min_value: float | None = None,
        positive: bool = False,
        allow_inf: bool = False,
    ) -> float | None:
        if key not in self.data or self.data[key] is None:
            if required:
                raise self.error(None, f"missing required field {key!r}")
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"must be a number, got {_kind(value)} {value!r}")
        out = float(value)
        if math.isnan(out) or (math.isinf(out) and not allow_inf):
            raise self.error(key, f"must be a finite number, got {value!r}")
        if positive and out <= 0:
            raise self.error(key, f"must be > 0, got {value!r}")
        if min_value is not None and out < min_value:
            raise self.error(key, f"must be >= {min_value:g}, got {value!r}")
        return out

    def integer(
        self, key: str, *, default: int | None = None, required: bool = False, min_value: int | None = None
    ) -> int | None:
        if key not in self.data or self.data[key] is None:
            if required:
                raise self.error(None, f"missing required field {key!r}")
            return default
        value = self.data[key]
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be a whole number, got {_kind(value)} {value!r}")
        if min_value is not None and value < min_value:
            raise self.error(key, f"must be >= {min_value}, got {value}")
        return value

    def text(self, key: str, *, default: str | None = None, choices: tuple[str, ...] = ()) -> str | None:
        if key not in self.data or self.data[key] is None:
            return default
        value = self.data[key]
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise self.error(key, f"must be text, got {_kind(value)}")
        out = str(value)
        if choices and out not in choices:
            raise self.error(key, f"must be one of {', '.join(choices)}; got {out!r}")
        return out

    def mapping(self, key: str, *, required: bool = False) -> Fields | None:
        if key not in self.data or self.data[key] is None:
            if required:
                raise self.error(None, f"missing required field {key!r}")
            return None
        value = self.data[key]
        if not isinstance(value, dict):
            raise self.error(key, f"must be a mapping (key: value lines), got {_kind(value)}")
        return Fields(self.doc, (*self.path, key), value)

    def items(self, key: str, *, required: bool = False) -> Iterator[tuple[int, Any]]:
        if key not in self.data or self.data[key] is None:
            if required:
                raise self.error(None, f"missing required field {key!r}")
            return iter(())
        value = self.data[key]
        if not isinstance(value, list) or not value:
            raise self.error(key, f"must be a non-empty list, got {_kind(value)}")
        return iter(enumerate(value))

    def child(self, key: str | int, value: Any) -> Fields:
        """Accessor over a nested mapping found by :meth:`items` or :meth:`raw`."""
        if not isinstance(value, dict):
            raise self.error(key, f"must be a mapping (key: value lines), got {_kind(value)}")
        return Fields(self.doc, (*self.path, key), value)
