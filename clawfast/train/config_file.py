"""A run's config file: TOML to a validated `clawfast.train.config.RunConfig`.

    config = load_config("examples/quickstart.toml")        # -> RunConfig
    config = load_config(path, overrides=["steps=3", "rollout.concurrency=2"])

Any problem raises `ConfigError` (a `ValueError`) naming the file and the field, e.g.
``quickstart.toml: field 'optim.lr': Input should be greater than 0``.

Relative input paths in the file (``model.path``, ``tasks.suite`` when it is a directory or a
``clawgym:PATH`` or ``pinchbench:PATH``, ``rollout.recorded_dir``) are resolved against the directory
of the TOML file, so a config reads the same inputs from any working directory; the same paths given
in an override (``--set model.path=...``) are the command line's, resolved against the working
directory, as any command's arguments are; ``run_dir`` (an output) is relative to the working
directory either way.

Override values are TOML values, or bare strings when they do not parse as TOML (``--set
run_dir=out/x``). TOML has no null: ``none`` (or ``"none"``) sets a field whose type allows None to
None (``--set optim.max_grad_norm=none``), in a file as in an override (`clawfast.train.config`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from clawfast.train.config import RunConfig, sets_none


class ConfigError(ValueError):
    """A configuration file is malformed; the message names the file and the field."""


# Inputs resolve against the config file's directory; `run_dir` (an output) against the working directory.
_PATH_FIELDS = (("model", "path"), ("tasks", "suite"), ("rollout", "recorded_dir"))


def _resolve_paths(raw: dict[str, Any], base: Path) -> None:
    """Make relative paths in `raw` relative to `base` (the TOML file's directory), in place.
    "embedded" and packaged model names (model) and built-in suite names are names, not paths."""
    from clawfast.pretrained import MODELS
    from clawfast.tasks.suites import BUILTIN_SUITES, CLAWGYM, PINCHBENCH

    for keys in _PATH_FIELDS:
        node = raw
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or not isinstance(node.get(keys[-1]), str):
            continue
        value = node[keys[-1]]
        if sets_none(keys, value):  # "none": the field is None (`clawfast.train.config`), not a path
            continue
        if keys == ("model", "path") and (value == "embedded" or value in MODELS):
            continue
        if keys == ("tasks", "suite") and value in BUILTIN_SUITES:
            continue
        prefix = next((p for p in (CLAWGYM, PINCHBENCH) if value.startswith(p)), None)
        if keys == ("tasks", "suite") and prefix is not None:
            path, sep, options = value[len(prefix):].partition("?")
            if not Path(path).expanduser().is_absolute():
                node[keys[-1]] = prefix + str((base / Path(path).expanduser()).resolve()) + sep + options
            continue
        if not Path(value).expanduser().is_absolute():
            node[keys[-1]] = str((base / Path(value).expanduser()).resolve())


def _parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=value``: the value is parsed as a TOML value, falling back to a bare string."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE")
    key, text = item.split("=", 1)
    keys = key.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return keys, value


def _apply(raw: dict[str, Any], keys: list[str], value: Any) -> None:
    node = raw
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(keys)}: {key!r} is not a section")
    node[keys[-1]] = value


def _describe(exc: ValidationError, source: str) -> ConfigError:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        lines.append(f"{source}: field {field!r}: {message}")
    return ConfigError("\n".join(lines))


def config_from_dict(raw: dict[str, Any], *, source: str = "<config>", base_dir: str | Path | None = None) -> RunConfig:
    """Validate a parsed config (paths relative to `base_dir`, default: the working directory)."""
    raw = _deep_copy(raw)
    _resolve_paths(raw, Path(base_dir) if base_dir is not None else Path.cwd())
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise _describe(exc, source) from None


def load_config(path: str | Path, *, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load, override (``section.key=value``, values in TOML syntax) and validate a TOML config."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a TOML file (not UTF-8 text)") from None
    except OSError as exc:  # a directory, no permission
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror or exc}") from None
    # The file's relative paths are the file's (its directory); an override's are the command line's
    # (the working directory): each is resolved against its own base before they are merged.
    _resolve_paths(raw, path.parent)
    for item in overrides:
        keys, value = _parse_override(item)
        single: dict[str, Any] = {}
        _apply(single, keys, value)
        _resolve_paths(single, Path.cwd())
        _apply(raw, keys, _lookup(single, keys))
    return config_from_dict(raw, source=path.name, base_dir=path.parent)


def _lookup(raw: dict[str, Any], keys: list[str]) -> Any:
    for key in keys:
        raw = raw[key]
    return raw


def _deep_copy(raw: Any) -> Any:
    if isinstance(raw, dict):
        return {k: _deep_copy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_deep_copy(v) for v in raw]
    return raw
