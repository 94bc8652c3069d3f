"""Config errors and the value checks every section's `__post_init__` uses."""

from __future__ import annotations

from collections.abc import Collection


class ConfigError(ValueError):
    """A run configuration is invalid; the message names the key and, if known, the file."""


def check_choice(section: str, name: str, value: object, choices: Collection) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{name}={value!r} is not one of {list(choices)}")


def check_positive(section: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{section}.{name}={value!r} must be {bound}")
