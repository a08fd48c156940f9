"""YAML in, validated pydantic model out, with errors that name the file, line and key path.

`load_model(path, Model, overrides)` reads YAML keeping the line of every key, applies
`--set a.b.c=value` overrides (values parsed as YAML), validates with
`context={"base_dir": folder of the file}`, and turns any failure into a ConfigError listing
each problem as `FILE:LINE: a.b.c: what is wrong (got VALUE)`.
"""

from __future__ import annotations

import typing
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from kestrel_sim.errors import ConfigError

Key = tuple  # a key path: ("workload", "arrivals", "rate") or ("x", 0, "y")


class _Located:
    """Where each key path came from: a line of the file, or a --set override."""

    def __init__(self, file: str):
        self.file = file
        self.lines: dict[Key, int] = {}
        self.overrides: dict[Key, str] = {}

    def where(self, path: Key) -> str:
        for n in range(len(path), -1, -1):
            prefix = tuple(path[:n])
            if prefix in self.overrides:
                return f"--set {self.overrides[prefix]}"
            if prefix in self.lines:
                return f"{self.file}:{self.lines[prefix]}"
            made = [k for k in self.overrides if n and k[:n] == prefix]
            if made:  # a mapping the file lacks, made by an override below it
                return f"--set {self.overrides[made[0]]}"
        return self.file


def _record_lines(node: yaml.Node, path: Key, lines: dict[Key, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = path + (key_node.value,)
                lines[key] = key_node.start_mark.line + 1
                _record_lines(value_node, key, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            _record_lines(item, path + (i,), lines)


def read_yaml(path: str | Path) -> tuple[object, _Located]:
    """Parse a YAML file; return its data and the line of every key path."""
    path = Path(path)
    located = _Located(str(path))
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror or err}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = f":{mark.line + 1}" if mark else ""
        context = ""
        if err.context and err.context_mark:
            context = f" ({err.context} started at line {err.context_mark.line + 1})"
        raise ConfigError(
            f"{path}{line}: invalid YAML: {err.problem or err.context}{context}"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    finally:
        loader.dispose()
    if node is not None:
        located.lines[()] = node.start_mark.line + 1
        _record_lines(node, (), located.lines)
    return data, located


def parse_override(text: str) -> tuple[Key, object]:
    """"a.b.c=value" -> (("a", "b", "c"), value parsed as YAML)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text}: expected KEY.PATH=VALUE, e.g. spec.k=4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: keep the text, validation says what it should be
    parts = tuple(int(p) if p.isdigit() else p for p in key.strip().split("."))
    return parts, value


def apply_override(data: dict, path: Key, value: object, text: str) -> None:
    """Set data[path] = value, creating mappings on the way; lists are indexed by number."""
    node = data
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
            continue
        if not isinstance(node, dict):
            where = ".".join(map(str, path[: i])) or "the top level"
            raise ConfigError(f"--set {text}: {where} is not a mapping, cannot set {part}")
        if not isinstance(node.get(part), (dict, list)):
            node[part] = {}
        node = node[part]
    last = path[-1]
    if isinstance(node, dict) or _has(node, last):
        node[last] = value
    else:
        raise ConfigError(f"--set {text}: cannot set {last} inside a {type(node).__name__}")


def load_model(path: str | Path, model: type[BaseModel], overrides=()) -> BaseModel:
    """Read, override, validate. Any problem raises one ConfigError listing them all."""
    path = Path(path)
    data, located = read_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: expected a mapping of keys at the top level, "
                          f"got {type(data).__name__}")
    for text in overrides:
        key, value = parse_override(text)
        apply_override(data, key, value, text)
        located.overrides[key] = text
    try:
        return model.model_validate(data, context={"base_dir": path.resolve().parent})
    except ValidationError as err:
        raise ConfigError(format_errors(err, data, model, located)) from None


# ---------------------------------------------------------------- error messages


def _has(node, part) -> bool:
    """True where `node[part]` exists (a mapping key or a list index)."""
    if isinstance(node, dict):
        return part in node
    return isinstance(node, list) and isinstance(part, int) and part < len(node)


def _data_path(loc: tuple, data, kind: str) -> tuple[Key, list[str], int]:
    """Split a pydantic `loc` into the key path present in the data and union tags.

    Returns (path, tags, depth of the first tag in the path)."""
    path: list = []
    tags: list[str] = []
    depth = -1
    node = data
    for i, part in enumerate(loc):
        if _has(node, part):
            node = node[part]
            path.append(part)
        elif i == len(loc) - 1 and kind in ("missing", "extra_forbidden"):
            path.append(part)  # a missing or unknown key
        else:
            tags.append(str(part))  # a union member or validator name
            depth = len(path) if depth < 0 else depth
    return tuple(path), tags, depth


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, Union, list, dict)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _literals(model: type[BaseModel]) -> set[str]:
    """Values of the model's Literal fields (discriminator tags)."""
    found = set()
    for f in model.model_fields.values():
        if typing.get_origin(f.annotation) is typing.Literal:
            found |= {str(a) for a in typing.get_args(f.annotation)}
    return found


def _pick(candidates: list[type[BaseModel]], data, tags: list[str]) -> type[BaseModel] | None:
    if not candidates:
        return None
    for model in candidates:  # a tag names the union member pydantic tried
        if model.__name__ in tags or _literals(model) & set(tags):
            return model
    keys = set(data) if isinstance(data, dict) else set()
    return max(candidates, key=lambda m: len(keys & _field_names(m)))


def _field_names(model: type[BaseModel]) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def _model_at(model: type[BaseModel], path: Key, data, tags: list[str]):
    """The model class that holds the mapping at `path`, following the data."""
    current = model
    node = data
    for part in path:
        if isinstance(part, int):
            node = node[part] if isinstance(node, list) and part < len(node) else None
            continue
        if current is None:
            return None
        field = next((f for n, f in current.model_fields.items() if (f.alias or n) == part), None)
        if field is None:
            return None
        node = node.get(part) if isinstance(node, dict) else None
        current = _pick(_models_in(field.annotation), node, tags)
    return current


def _got(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_EXPECTED = {
    "int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
    "dict": "a mapping", "model": "a mapping", "list": "a list", "tuple": "a list",
}


def _describe(err: dict, path: Key, data, model, tags) -> str:
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "extra_forbidden":
        owner = _model_at(model, path[:-1], data, tags)
        allowed = ", ".join(sorted(_field_names(owner))) if owner else "?"
        return f"unknown key '{path[-1]}'; allowed keys: {allowed}"
    if kind == "missing":
        return "missing required key"
    if kind == "union_tag_invalid":
        return f"must be one of {ctx.get('expected_tags')} (got {_got(ctx.get('tag'))})"
    if kind == "union_tag_not_found":
        key = str(ctx.get("discriminator", "?")).strip("'")
        return f"missing key '{key}' that says which kind this is"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
              "less_than_equal": "<="}
    if kind in bounds:
        bound = next(iter(ctx.values()), "?")
        return f"must be {bounds[kind]} {bound} (got {_got(value)})"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected', '?')} (got {_got(value)})"
    if kind in ("too_short", "too_long"):
        bound = ctx.get("min_length") if kind == "too_short" else ctx.get("max_length")
        return (f"needs {'at least' if kind == 'too_short' else 'at most'} {bound} "
                f"entr{'y' if bound == 1 else 'ies'} (got {ctx.get('actual_length')})")
    if kind == "int_from_float":
        return f"expected an integer (got {_got(value)})"
    base = kind.removesuffix("_type").removesuffix("_parsing")
    if base in _EXPECTED and kind != base:
        return f"expected {_EXPECTED[base]} (got {_got(value)})"
    msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    # a validator's own message says what it got; so does one about a mapping or list
    if kind == "value_error" or isinstance(value, (dict, list)) or value is None:
        return msg
    return f"{msg} (got {_got(value)})"


def describe_errors(error: ValidationError, data, model: type[BaseModel]) -> list[tuple[Key, str]]:
    """(key path, what is wrong) per problem, without repeats: a failed plain union reports
    only the member with the fewest problems."""
    errors = error.errors(include_url=False)
    parsed = []
    for e in errors:
        path, tags, depth = _data_path(tuple(e["loc"]), data, e["type"])
        if e["type"] == "union_tag_invalid":
            path = path + (str(e["ctx"]["discriminator"]).strip("'"),)
        parsed.append((e, path, tags, depth))
    # a failed plain union reports every member: keep the member with the fewest problems
    groups: dict[Key, dict[str, int]] = {}
    for _, path, tags, depth in parsed:
        if tags:
            counts = groups.setdefault(path[:depth], {})
            counts[tags[0]] = counts.get(tags[0], 0) + 1
    problems: list[tuple[Key, str]] = []
    for err, path, tags, depth in parsed:
        counts = groups.get(path[:depth]) if tags else None
        if counts and len(counts) > 1 and tags[0] != min(counts, key=counts.get):
            continue
        problem = (path, _describe(err, path, data, model, tags))
        if problem not in problems:
            problems.append(problem)
    return problems


def key_name(path: Key) -> str:
    return ".".join(map(str, path)) or "(top level)"


def count_problems(n: int) -> str:
    return f"{n} problems" if n > 1 else "1 problem"


def format_errors(error: ValidationError, data, model, located: _Located) -> str:
    """One line per problem: `WHERE: key.path: what is wrong`."""
    problems = describe_errors(error, data, model)
    lines = [f"{located.where(path)}: {key_name(path)}: {what}" for path, what in problems]
    return f"{located.file} does not validate ({count_problems(len(lines))}):\n" + "\n".join(lines)
