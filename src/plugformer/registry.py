"""A tiny validated name -> class table, one per variant axis (score functions, position schemes, ...)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar


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
