"""A tiny validated name -> class table, one per variant axis (score functions, position schemes, ...)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar


if TYPE_CHECKING:
    from .configuration import PlugformerConfig


T = TypeVar("T")


class Registry(Generic[T]):
    """Maps the string a config stores (e.g. `attention_score="additive"`) to the class that implements it.

    Args:
        axis (`str`):
            The config field this table serves; it is named in every error message.
    """

    def __init__(self, axis: str):
        self.axis = axis
        self._table: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator adding `cls` under `name`; a duplicate name raises instead of silently replacing."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.axis}: a registered name must be a non-empty string, got {name!r}")

        def add(cls: type[T]) -> type[T]:
            if name in self._table:
                raise ValueError(f"{self.axis}={name!r} is already registered to {self._table[name].__name__}")
            self._table[name] = cls
            cls.name = name
            return cls

        return add

    def get(self, name: str) -> type[T]:
        """The class registered as `name`; an unknown name raises a `ValueError` listing the choices."""
        if name not in self._table:
            raise ValueError(f"{self.axis}={name!r} is not one of {self.names()}")
        return self._table[name]

    def names(self) -> list[str]:
        return list(self._table)

    def choices(self) -> str:
        """The registered names as a help string, `"a | b | c"`: option help that a new variant extends by itself."""
        return " | ".join(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)


class ConfigHooks:
    """The config-facing side of a registered variant (a score function, a position scheme). `PlugformerConfig`
    checks each variant's own fields through these hooks only, and tests no variant's name.

    Class attributes:
        config_fields (`tuple[str, ...]`): the config fields this variant owns: it reads them and `validate_config`
            checks them. A field some registered variant owns and none of the chosen ones does is unused.
        unused_fields_refused (`bool`, defaults to `False`): whether a config that chooses other variants may not set
            this variant's unused fields to values only it would act on (`refuse_unused_config` decides); a preset's
            values for them are dropped when another variant is chosen (`PlugformerConfig.from_preset`).
    """

    config_fields: tuple[str, ...] = ()
    unused_fields_refused = False

    @classmethod
    def validate_config(cls, config: PlugformerConfig) -> None:
        """Raises a `ValueError` (`TypeError` for a wrong type) naming the field, its value and what is allowed, if
        `config` cannot use this variant. Called for the chosen variants only."""

    @classmethod
    def refuse_unused_config(cls, config: PlugformerConfig) -> None:
        """Raises a `ValueError` naming the field if `config`, which chose other variants, sets one of this variant's
        fields to a value only this variant would act on (whoever set it expects an effect). Called where
        `unused_fields_refused` and none of the chosen variants owns the field."""


def unused_fields(chosen: tuple[type[ConfigHooks], ...], registries: tuple[Registry[Any], ...]) -> dict[type, set[str]]:
    """The registered variants of `registries` that refuse their fields unused, each with the fields it owns that
    none of the `chosen` variants does."""
    owned = {field for variant in chosen for field in variant.config_fields}
    found = {}
    for registry in registries:
        for name in registry:
            variant = registry.get(name)
            fields = set(variant.config_fields) - owned
            if variant not in chosen and variant.unused_fields_refused and fields:
                found[variant] = fields
    return found


def choice(field: str, value: Any, choices: list[str]) -> None:
    """Raises `ValueError` unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{field}={value!r} is not one of {choices}")


def positive(config: PlugformerConfig, *fields: str) -> None:
    """Raises `TypeError`/`ValueError` unless each of `fields` of `config` is `None` or a positive int."""
    for field in fields:
        value = getattr(config, field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{field}={value!r} must be an int")
        if value < 1:
            raise ValueError(f"{field}={value!r} must be a positive integer")


def in_range(config: PlugformerConfig, field: str, low: float, high: float, closed_high: bool = False) -> None:
    """Raises `TypeError`/`ValueError` unless `config.<field>` is a number in [low, high) (or [low, high])."""
    value = getattr(config, field)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{field}={value!r} must be a number")
    if not (low <= value <= high if closed_high else low <= value < high):
        raise ValueError(f"{field}={value!r} must lie in [{low}, {high}{']' if closed_high else ')'}")
