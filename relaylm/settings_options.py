"""Click options generated from pydantic-settings models, so ``--help`` always lists every setting
with its environment variable and default, and flags and environment can never drift apart."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings


@dataclass(frozen=True)
class Repeated:
    """A setting one command takes several times (``serve --model a --model b``): click collects a
    tuple, which the command spreads over its processes, each of which reads one value."""

    note: str  # appended to the field's description
    env_format: str  # how the environment variable holds several values
    default: str  # what the command does when none is given


def _click_type(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        inner = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _click_type(inner[0])
    if origin is typing.Literal:
        return click.Choice([str(choice) for choice in typing.get_args(annotation)])
    return {int: int, float: float, Path: click.Path(path_type=Path)}.get(annotation, str)


def default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "computed"
    if info.default is PydanticUndefined or info.default is None:
        return "none"
    return str(info.default)


def env_name(settings_cls: type[BaseSettings], name: str) -> str:
    prefix = settings_cls.model_config.get("env_prefix", "")
    return f"{prefix}{name}".upper()


def settings_option_names(settings_cls: type[BaseSettings]) -> list[str]:
    return list(settings_cls.model_fields)


def settings_options(
    *settings_classes: type[BaseSettings], repeated: Mapping[str, Repeated] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a click command with one ``--flag`` per field of the given settings classes; the
    fields named in ``repeated`` may be given several times (an empty tuple when none is)."""
    fields: dict[str, tuple[type[BaseSettings], FieldInfo]] = {}
    for settings_cls in settings_classes:
        for name, info in settings_cls.model_fields.items():
            fields.setdefault(name, (settings_cls, info))

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        for name, (settings_cls, info) in reversed(list(fields.items())):
            command = _option(name, env_name(settings_cls, name), info, (repeated or {}).get(name))(command)
        return command

    return decorate


def _option(name: str, variable: str, info: FieldInfo, repeated: Repeated | None) -> Callable[..., Any]:
    flag = "--" + name.replace("_", "-")
    description = info.description or ""
    if repeated is not None:
        env = f"{variable}, {repeated.env_format}"
        help_text = f"{description} {repeated.note} [env: {env}; default: {repeated.default}]"
        return click.option(flag, name, type=_click_type(info.annotation), multiple=True, help=help_text)
    help_text = f"{description} [env: {variable}; default: {default_text(info)}]"
    if info.annotation is bool:
        return click.option(flag + "/--no-" + flag[2:], name, default=None, help=help_text)
    return click.option(flag, name, type=_click_type(info.annotation), default=None, help=help_text)


def build_settings(settings_cls: type[BaseSettings], values: dict[str, Any], names: Iterable[str] | None = None) -> Any:
    """Flags that were given override the environment; the rest come from env or defaults."""
    allowed = set(names if names is not None else settings_cls.model_fields)
    given = {name: value for name, value in values.items() if value is not None and name in allowed}
    return settings_cls(**given)
