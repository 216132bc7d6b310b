"""How the contract grows: a field, or a new form of a field's value, says since which version it
exists, and one rule writes a job for an older reader.

A field marked ``Since(n)`` (``Annotated[T, Since(n)]``) is left out of a payload written for a
version before ``n`` while its value is its default (a reader of that version then reads the
default it always had); a value that needs version ``n`` (by default: any other value) makes the
job unwritable for that reader, a ``ValueError`` naming the field, so it is never silently lost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class Since:
    version: int
    needs: Callable[[Any], bool] | None = None  # which values need it; None: any but the default
    what: str | None = None  # the feature, for the error (default: the field's path)


def since_of(field: FieldInfo) -> Since | None:
    return next((meta for meta in field.metadata if isinstance(meta, Since)), None)


def written_for(model: BaseModel, version: int) -> dict[str, Any]:
    """``model``'s JSON as a reader of ``version`` reads it; ``ValueError`` where it cannot."""
    data = model.model_dump(mode="json")
    _strip(model, data, version, "")
    return data


def _strip(model: BaseModel, data: dict[str, Any], version: int, path: str) -> None:
    for name, field in type(model).model_fields.items():
        if field.exclude:
            continue  # never written
        value, where = getattr(model, name), f"{path}{name}"
        since = since_of(field)
        if since is not None and since.version > version:
            default = field.get_default(call_default_factory=True)
            if since.needs(value) if since.needs is not None else value != default:
                raise ValueError(f"version {version} has no {since.what or where} (since version {since.version})")
            if since.needs is None:
                del data[name]  # its default: read as the default it always had
                continue
        _strip_value(value, data[name], version, where)


def _strip_value(value: Any, data: Any, version: int, path: str) -> None:
    if isinstance(value, BaseModel):
        _strip(value, data, version, f"{path}.")
    elif isinstance(value, list | tuple):
        for index, (item, item_data) in enumerate(zip(value, data, strict=True)):
            _strip_value(item, item_data, version, f"{path}[{index}]")
