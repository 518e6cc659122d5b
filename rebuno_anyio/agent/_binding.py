"""How an execution's input reaches the handler: its signature is the schema.

Three shapes (SEED 004): keyword fields (each parameter is an input field; one
without a default is required), a single pydantic model (the input is
validated against it), or raw passthrough (a single `dict`, `Any` or
unannotated parameter gets the input unchanged).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError, create_model

__all__ = ["InputError", "Signature", "json_schema_of"]

_FIELD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class InputError(ValueError):
    """The input does not fit the handler; the message is the `input_invalid` detail."""


def json_schema_of(schema: dict[str, Any] | type[BaseModel] | None) -> dict[str, Any] | None:
    """A JSON Schema dict from a dict or a pydantic model class."""
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return schema.model_json_schema()
    if schema is None or isinstance(schema, dict):
        return schema
    raise TypeError(f"output_schema must be a JSON Schema dict or a pydantic model, got {schema!r}")


class Signature:
    """The input contract of one handler."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._sig = inspect.signature(fn)
        try:
            hints = typing.get_type_hints(fn)
        except Exception:
            hints = {}
        self._hints = hints
        params = [p for p in self._sig.parameters.values() if p.kind in _FIELD_KINDS]
        self._fields = params
        self.model: type[BaseModel] | None = None
        self.shape = "fields"
        if len(params) == 1 and len(self._sig.parameters) == 1:
            only = params[0]
            annotation = hints.get(only.name, only.annotation)
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                self.shape, self.model = "model", annotation
            elif (
                annotation in (inspect.Parameter.empty, Any, dict)
                or typing.get_origin(annotation) is dict
            ):
                self.shape = "raw"
        self.required = [p.name for p in params if p.default is inspect.Parameter.empty]

    def bind(self, value: Any) -> dict[str, Any]:
        """The keyword arguments to call the handler with.

        Raises:
            InputError: a required field is missing, or the model rejects it.
        """
        if self.shape == "raw":
            return {self._fields[0].name: value}
        data = value if isinstance(value, dict) else {}
        if self.shape == "model":
            assert self.model is not None
            try:
                return {self._fields[0].name: self.model.model_validate(data)}
            except ValidationError as err:
                raise InputError(f"input validation failed: {err}") from None
        missing = [name for name in self.required if name not in data]
        if missing:
            raise InputError(f"missing required input fields: {', '.join(missing)}")
        return {p.name: data[p.name] for p in self._fields if p.name in data}

    def json_schema(self) -> dict[str, Any] | None:
        """The input's JSON Schema, or `None` for raw passthrough (or when the
        annotations have none)."""
        if self.shape == "raw":
            return None
        try:
            if self.model is not None:
                return self.model.model_json_schema()
            fields: dict[str, Any] = {
                p.name: (
                    self._hints.get(p.name, Any),
                    ... if p.default is inspect.Parameter.empty else p.default,
                )
                for p in self._fields
            }
            name = getattr(self.fn, "__name__", "input")
            return create_model(name, **fields).model_json_schema()
        except Exception:
            return None
