"""Build a `jgrpo.config.Config`: defaults, then a YAML file, then `section.field=value` overrides.

Every value is coerced to its field's declared type. Mistakes fail early and say exactly what is wrong: an
unknown key names its full path and the closest valid names; a bad value names the field, the value and what
is allowed. `save_config` writes the resolved config into a run directory, loadable again.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from etils import epath

from jgrpo.config import Config, ConfigError


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Coerce a YAML/CLI value to the annotated type `tp`, or raise ConfigError naming `path`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError:
                pass
        raise ConfigError(f"{path}={value!r} is not allowed: expected " + " or ".join(_type_name(a) for a in args))
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{path}={value!r} is not allowed: {_type_name(tp)}")
    if origin is tuple:
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            value = [value]
        elem = args[0]
        return tuple(_coerce(v, elem, f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r} is not allowed: expected a mapping of {tp.__name__} fields")
        return _build(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{path}={value!r} is not allowed: expected a boolean (true/false)")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}={value!r} is not allowed: expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}={value!r} is not allowed: expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}={value!r} is not allowed: expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}={value!r} is not allowed: expected a number") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{path}={value!r} is not allowed: expected a string")
        return str(value)
    raise ConfigError(f"{path}: unsupported field type {tp!r}")


def _build(cls: type, values: dict, path: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{full}'{hint}")
        kwargs[key] = _coerce(value, hints[key], full)
    try:
        return cls(**kwargs)
    except TypeError as e:  # missing required fields and the like
        raise ConfigError(f"{path or 'config'}: {e}") from None


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{k}' is a value, not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """`["grpo.beta=0.0", "sampler.temperature=0.7"]` -> nested dict with YAML-parsed values."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' has no '=': overrides look like section.field=value "
                              "(e.g. grpo.beta=0.0), after the config file")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_yaml(path) -> Any:
    """The parsed file ({} when empty); a syntax error names the file, line, column and the parser's reason."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}: line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        reason = getattr(e, "problem", None) or str(e).splitlines()[0]
        context, opened = getattr(e, "context", None), getattr(e, "context_mark", None)
        if context and opened:
            context += f" that starts at line {opened.line + 1}, column {opened.column + 1}"
        raise ConfigError(f"{where}: invalid YAML: {reason}" + (f" ({context})" if context else "")
                          + ". Check the indentation (spaces, not tabs) and the brackets and quotes there") from None
    return {} if loaded is None else loaded


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- dotted overrides, validated and typed."""
    tree: dict = {}
    if path is not None:
        path = epath.Path(path)  # a local file or one in a bucket (a run directory's config.yaml)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path} (configs/ holds the shipped ones, e.g. "
                              "configs/tiny.yaml)")
        loaded = _read_yaml(path)
        if not isinstance(loaded, dict):
            kind = "a list" if isinstance(loaded, list) else f"a single {type(loaded).__name__} value"
            raise ConfigError(f"{path}: the file is {kind}; a config file must be a mapping of sections "
                              "(model:, sampler:, grpo:, ...), as in configs/tiny.yaml")
        tree = loaded
    tree = _merge(tree, parse_overrides(overrides or []))
    return _build(Config, tree)


def to_dict(config: Any) -> dict:
    return dataclasses.asdict(config)


def save_config(config: Config, run_dir: str | Path) -> Path:
    """Write the resolved config as YAML into the run directory (and return the path)."""
    run_dir = epath.Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.yaml"
    # JSON round trip turns tuples into lists so the YAML is plain and loads back through load_config.
    out.write_text(yaml.safe_dump(json.loads(json.dumps(to_dict(config))), sort_keys=False))
    return out
