"""One typed settings model per runtime process, and everything derived from it.

A process's settings (`StageSettings`, `RouterSettings`) are a pydantic model whose fields carry their
own docstrings, bounds and defaults. From that one model come:

- the `omnikube <process>` flags (`add_arguments`, `from_args`): one `--kebab-case` flag per field,
  its help from the field's docstring, its value checked by the field's own type and bounds;
- the command line of a local process (`to_argv`), used by `omnikube serve`;
- a container's command and env (`pod_command`), used by the operator's builders. A value only the
  pod knows (its IP) is declared on the field with `FromPod`: the command says `$(ENV)`, which the
  kubelet expands from an env var filled by the downward API.

So nothing about how a process is started is written twice. To add a setting, add a field with a
docstring to the model; the flag, the launcher's argv and the pod command follow.

This module imports only pydantic: the operator imports the settings models.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

__all__ = ["FromPod", "PodCommand", "ProcessSettings"]

S = TypeVar("S", bound="ProcessSettings")


@dataclass(frozen=True)
class FromPod:
    """Field metadata: in a pod, the value comes from the downward API (`fieldPath`) through env `env`."""

    env: str
    field_path: str


@dataclass(frozen=True)
class PodCommand:
    """A container's `command` and the `env` entries the command refers to."""

    command: list[str]
    env: list[dict[str, Any]]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_bool(annotation: Any) -> bool:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation is bool or (_is_union(annotation) and args == [bool])


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _render(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value)) if abs(value) < 1e15 else repr(value)
    return str(value.value if hasattr(value, "value") else value)


class ProcessSettings(BaseModel):
    """Base of a process's settings; subclasses name their subcommand in `command`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    command: ClassVar[str]
    """The `omnikube` subcommand that runs the process (`stage`, `router`)."""

    # -- command line ------------------------------------------------------------------------------

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field: help from its docstring, value checked by the field's type and bounds."""
        for name, field in cls.model_fields.items():
            help_text = (field.description or name).rstrip(".")
            required = field.is_required()
            default = None if required else field.get_default(call_default_factory=True)
            if default is not None and not required:
                help_text += f" (default: {_render(default)})"
            pod = next((m for m in field.metadata if isinstance(m, FromPod)), None)
            if pod is not None:
                help_text += f"; in a pod: $({pod.env}), the downward API's {pod.field_path}"
            if _is_bool(field.annotation):
                parser.add_argument(
                    _flag(name), dest=name, action=argparse.BooleanOptionalAction, default=default, help=help_text
                )
                continue
            parser.add_argument(
                _flag(name),
                dest=name,
                type=_checker(cls, name),
                required=required,
                default=default,
                metavar=name.upper(),
                help=help_text,
            )

    @classmethod
    def from_args(cls: type[S], args: argparse.Namespace) -> S:
        """The settings from parsed flags (each value was already checked by its flag)."""
        return cls.model_validate({name: getattr(args, name) for name in cls.model_fields})

    def to_argv(self) -> list[str]:
        """Flags that reproduce these settings: every field given explicitly (defaults stay implicit, so
        a process of a newer version keeps its own defaults)."""
        argv: list[str] = []
        fields = type(self).model_fields
        for name in fields:
            if name not in self.model_fields_set:
                continue
            value = getattr(self, name)
            field = fields[name]
            if _is_bool(field.annotation):
                if value is not None:
                    argv.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
            elif value is not None:
                argv += [_flag(name), _render(value)]
        return argv

    def pod_command(self, executable: str = "omnikube") -> PodCommand:
        """The container command for these settings; `FromPod` fields not set explicitly read their env."""
        command = [executable, self.command, *self.to_argv()]
        env: list[dict[str, Any]] = []
        for name, field in type(self).model_fields.items():
            pod = next((m for m in field.metadata if isinstance(m, FromPod)), None)
            if pod is None or name in self.model_fields_set:
                continue
            command += [_flag(name), f"$({pod.env})"]
            env.append({"name": pod.env, "valueFrom": {"fieldRef": {"fieldPath": pod.field_path}}})
        return PodCommand(command, env)


def _checker(cls: type[ProcessSettings], name: str) -> Any:
    """An argparse `type` that validates one flag's text as the field would, with pydantic's message."""
    field = cls.model_fields[name]
    annotation: Any = field.annotation
    if field.metadata:  # bounds (ge, le...) travel as Annotated metadata
        annotation = typing.Annotated[(annotation, *field.metadata)]
    adapter: TypeAdapter[Any] = TypeAdapter(annotation)

    def check(text: str) -> Any:
        try:
            return adapter.validate_python(text, strict=False)
        except ValidationError as err:
            raise argparse.ArgumentTypeError(f"{text!r}: {err.errors()[0]['msg']}") from None

    check.__name__ = name
    return check
