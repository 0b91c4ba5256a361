"""The set of known pipelines: lookup by name or alias, and selection by a model's class names.

Built from loaded files, it checks what no single file can: aliases never clash with names, and no
architecture or diffusers class selects two pipelines (so a model never matches two).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from omni_runtime.registry.errors import RegistryError
from omni_runtime.registry.loader import RegisteredPipeline
from omni_runtime.registry.model_files import ModelSignature
from omni_runtime.spec import PipelineSpec

__all__ = ["PipelineRegistry"]


class PipelineRegistry:
    """Known pipeline topologies, by name."""

    def __init__(self, entries: Iterable[RegisteredPipeline]) -> None:
        self._entries: dict[str, RegisteredPipeline] = {}
        for entry in entries:
            if entry.name in self._entries:
                raise RegistryError(
                    f"{entry.source}: pipeline {entry.name!r} is also defined in "
                    f"{self._entries[entry.name].source}; keep one"
                )
            self._entries[entry.name] = entry
        self._aliases = self._check_aliases()
        self._check_matches()

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._lookup(name) is not None

    def __iter__(self) -> Iterator[PipelineSpec]:
        return (self._entries[n].spec for n in self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        """Pipeline names, sorted."""
        return sorted(self._entries)

    def items(self) -> list[tuple[str, PipelineSpec]]:
        """(name, topology) pairs in name order, like a mapping's."""
        return [(n, self._entries[n].spec) for n in self.names()]

    def aliases(self) -> dict[str, str]:
        """Alias -> pipeline name."""
        return dict(self._aliases)

    def entry(self, name: str) -> RegisteredPipeline:
        """The registered pipeline called `name` (or with that alias), with its source file."""
        found = self._lookup(name)
        if found is None:
            aliases = ", ".join(f"{a} -> {n}" for a, n in sorted(self._aliases.items()))
            raise RegistryError(
                f"pipeline {name!r} is unknown; known pipelines are {self.names()}"
                + (f" (aliases: {aliases})" if aliases else "")
                + "; use one of them, or leave pipeline unset to select it from the model"
            )
        return found

    def get(self, name: str) -> PipelineSpec:
        """The topology called `name` (or with that alias); RegistryError listing the known names."""
        return self.entry(name).spec

    def match(self, signature: ModelSignature) -> PipelineSpec:
        """The one pipeline whose `match` lists the model's architectures or diffusers class."""
        hits: list[str] = []
        for name in self.names():
            spec = self._entries[name].spec
            if signature.diffusers_class in spec.match.diffusers_classes or set(signature.architectures) & set(
                spec.match.architectures
            ):
                hits.append(name)
        if len(hits) == 1:
            return self._entries[hits[0]].spec
        if hits:
            raise RegistryError(
                f"the model at {signature.path} matches several pipelines {hits} (it has "
                f"{signature.describe()}); set pipeline to one of them"
            )
        raise RegistryError(
            f"no pipeline matches the model at {signature.path}: it has {signature.describe()}. "
            f"Known pipelines: {self.describe_matches()}. Set pipeline to one of them, "
            "or add a pipeline file whose match lists this class"
        )

    def describe_matches(self) -> str:
        """`name (what it matches)` for every pipeline, for error messages and CLI listings."""
        parts = []
        for name in self.names():
            match = self._entries[name].spec.match
            what = []
            if match.architectures:
                what.append("architectures " + ", ".join(match.architectures))
            if match.diffusers_classes:
                what.append("diffusers " + ", ".join(match.diffusers_classes))
            parts.append(f"{name} ({'; '.join(what) or 'by name only'})")
        return "; ".join(parts)

    def _lookup(self, name: str) -> RegisteredPipeline | None:
        key = name.strip().lower()
        key = self._aliases.get(key, key)
        return self._entries.get(key)

    def _check_aliases(self) -> dict[str, str]:
        aliases: dict[str, str] = {}
        for entry in self._entries.values():
            for alias in entry.aliases:
                other = self._entries.get(alias) or (self._entries[aliases[alias]] if alias in aliases else None)
                if other is not None and other.name != entry.name:
                    raise RegistryError(
                        f"{entry.source}: aliases: {alias!r} is already the name or an alias of pipeline "
                        f"{other.name!r} ({other.source}); choose another alias"
                    )
                aliases[alias] = entry.name
        return aliases

    def _check_matches(self) -> None:
        owners: dict[tuple[str, str], RegisteredPipeline] = {}
        for entry in self._entries.values():
            keys = [("architecture", a) for a in entry.spec.match.architectures]
            keys += [("diffusers class", c) for c in entry.spec.match.diffusers_classes]
            for key in keys:
                other = owners.setdefault(key, entry)
                if other is not entry:
                    raise RegistryError(
                        f"{entry.source}: match: {key[0]} {key[1]!r} also selects pipeline {other.name!r} "
                        f"({other.source}), so a model would match two pipelines; remove it from one, or "
                        f"name your pipeline {other.name!r} to replace that one"
                    )
