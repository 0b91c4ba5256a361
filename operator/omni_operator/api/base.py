"""The mechanics every CRD model shares: the base model, CEL rules with a Python twin, quantities.

A constraint lives in one place. Bounds, enums and patterns are pydantic `Field` arguments, which the
generator (`omni_operator.crdgen`) turns into OpenAPI; cross-field rules are `Rule`s, which carry both
the CEL expression the apiserver evaluates at admission and the Python check `omnikube render` runs
offline, with one message for both.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    Strict,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "Bool",
    "CRDInfo",
    "CustomResource",
    "ObjectMeta",
    "PrinterColumn",
    "Int",
    "KubeModel",
    "QUANTITY_PATTERN",
    "Quantity",
    "Rule",
    "list_map",
    "list_set",
    "parse_quantity",
    "quantity_bytes",
    "unique_rule",
    "validation_messages",
]

Int = Annotated[int, Strict()]
"""An integer that refuses `"2"` and `true`, as the apiserver does."""
Bool = Annotated[bool, Strict()]
"""A boolean that refuses `"yes"` and `1`, as the apiserver does."""

QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
"""A non-negative Kubernetes quantity (`8Gi`, `500m`, `4`, `1e3`)."""

_SUFFIXES = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}


def _check_quantity(value: Any) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{value} is negative; a quantity is 0 or more")
        return value
    if isinstance(value, str):
        if not re.match(QUANTITY_PATTERN, value):
            raise ValueError(f"{value!r} is not a Kubernetes quantity; write it like 8Gi, 512Mi, 500m or 4")
        return value
    raise ValueError(f"{value!r} is not a Kubernetes quantity; use an integer or a string like 8Gi, 512Mi or 500m")


Quantity = Annotated[
    int | str,
    PlainValidator(_check_quantity),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}),
]
"""A Kubernetes quantity: an integer, or a string such as `8Gi`, `512Mi` or `500m`."""


def parse_quantity(value: int | str) -> Decimal:
    """The numeric value of a quantity (`"2Gi"` -> 2147483648, `"500m"` -> 0.5)."""
    if isinstance(value, int):
        return Decimal(value)
    match = re.match(r"^\+?([0-9.]+)([eE][-+]?[0-9.]+|[KMGTPE]i|[numkMGTPE])?$", value)
    if not match or not re.match(QUANTITY_PATTERN, value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity; write it like 8Gi, 512Mi, 500m or 4")
    number, suffix = Decimal(match.group(1)), match.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return number * Decimal(10) ** Decimal(suffix[1:])
    return number * _SUFFIXES[suffix]


def quantity_bytes(value: int | str) -> int:
    """A quantity as a whole number of bytes, rounded up (`"512Mi"` -> 536870912)."""
    return int(parse_quantity(value).to_integral_value(rounding=ROUND_CEILING))


@dataclass(frozen=True)
class Rule:
    """A cross-field rule, evaluated by the apiserver (CEL) and offline (Python) with one message.

    `cel` sees the object as `self`, with the camelCase names of the CRD; `check` gets the pydantic
    model and returns True when the object is valid. The message names the field and what to change.
    Keep CEL cheap: every list or string it walks needs a maxItems or maxLength bound.
    """

    cel: str
    message: str
    check: Callable[[Any], bool]

    def to_schema(self) -> dict[str, str]:
        return {"rule": self.cel, "message": self.message}


def unique_rule(field: str, attr: str, keys: Sequence[tuple[str, str]] = (), *, message: str) -> Rule:
    """A rule that the list `field` (Python attribute `attr`) has no two entries with the same key.

    `keys` are (CRD name, Python attribute) pairs; none means the entries themselves are compared.
    """
    if keys:
        same = " && ".join(f"y.{k} == x.{k}" for k, _ in keys)
    else:
        same = "y == x"
    cel = f"!has(self.{field}) || self.{field}.all(x, self.{field}.exists_one(y, {same}))"

    def key(item: Any) -> Any:
        return tuple(getattr(item, a) for _, a in keys) if keys else item

    def check(model: Any) -> bool:
        items = [key(i) for i in getattr(model, attr) or ()]
        return len(items) == len(set(items))

    return Rule(cel=cel, message=message, check=check)


def _schema_extra(schema: dict[str, Any], cls: type[Any]) -> None:
    rules: tuple[Rule, ...] = getattr(cls, "validation_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.to_schema() for r in rules]


class KubeModel(BaseModel):
    """Base of every CRD model: camelCase names on the wire, unknown fields refused, rules checked."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=_schema_extra,
    )

    validation_rules: ClassVar[tuple[Rule, ...]] = ()
    """Cross-field rules of this object; the generator writes them as `x-kubernetes-validations`."""

    @model_validator(mode="after")
    def _check_rules(self) -> KubeModel:
        broken = [rule.message for rule in type(self).validation_rules if not rule.check(self)]
        if broken:
            raise ValueError("; ".join(broken))
        return self

    def to_dict(self) -> dict[str, Any]:
        """The object as the apiserver stores it: camelCase names, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def list_map(*keys: str) -> dict[str, Any]:
    """Schema extras for a list of objects identified by `keys` (server-side apply merges by key)."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


def list_set() -> dict[str, Any]:
    """Schema extras for a list of unique scalars."""
    return {"x-kubernetes-list-type": "set"}


def validation_messages(error: ValidationError) -> list[str]:
    """One line per problem, `path: message`, with paths written as in the CRD (`spec.stages[1].name`)."""
    lines = []
    for item in error.errors():
        path = ""
        for part in item["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {message}" if path else message)
    return lines


GROUP = "omnikube.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


@dataclass(frozen=True)
class PrinterColumn:
    """A column of `kubectl get`."""

    name: str
    json_path: str
    type: str = "string"
    description: str = ""
    priority: int = 0
    """0 shows in `kubectl get`; 1 only in `kubectl get -o wide`."""

    def to_dict(self) -> dict[str, Any]:
        column: dict[str, Any] = {"name": self.name, "type": self.type, "jsonPath": self.json_path}
        if self.description:
            column["description"] = self.description
        if self.priority:
            column["priority"] = self.priority
        return column


@dataclass(frozen=True)
class CRDInfo:
    """What a CRD says besides its schema: names, columns, subresources."""

    kind: str
    plural: str
    short_names: tuple[str, ...]
    printer_columns: tuple[PrinterColumn, ...]
    scale: bool = False
    """Add the /scale subresource (spec.replicas, status.replicas, status.selector)."""
    categories: tuple[str, ...] = ("omnikube",)

    @property
    def name(self) -> str:
        return f"{self.plural}.{GROUP}"


class ObjectMeta(KubeModel):
    """The standard object metadata; only the fields omnikube reads are typed, the rest are kept."""

    model_config = ConfigDict(extra="allow")

    name: str = Field("", description="Object name, unique in its namespace.")
    namespace: str = Field("", description="Namespace of the object; empty before it is created.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels of the object.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations of the object.")
    generation: Int | None = Field(None, description="Spec generation, set by the apiserver.")
    uid: str | None = Field(None, description="Unique id of the live object, set by the apiserver.")


class CustomResource(KubeModel):
    """Base of a whole custom object (apiVersion, kind, metadata, spec, status)."""

    crd: ClassVar[CRDInfo]

    api_version: str = Field(API_VERSION, description="Always omnikube.io/v1alpha1.")
    kind: str = Field(description="The object kind.")
    metadata: ObjectMeta = Field(default_factory=ObjectMeta, description="Standard object metadata.")

    @model_validator(mode="before")
    @classmethod
    def _default_kind(cls, data: Any) -> Any:
        if isinstance(data, dict) and "kind" not in data:
            return {**data, "kind": cls.crd.kind}
        return data

    @model_validator(mode="after")
    def _check_type(self) -> CustomResource:
        if self.api_version != API_VERSION:
            raise ValueError(f"apiVersion: {self.api_version!r} is not served; use {API_VERSION}")
        if self.kind != self.crd.kind:
            raise ValueError(f"kind: {self.kind!r} is not {self.crd.kind}; use kind: {self.crd.kind}")
        return self
