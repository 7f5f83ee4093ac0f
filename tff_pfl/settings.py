"""Settings: one frozen dataclass per algorithm, the only place a default is written.

Every algorithm of `processes/` declares its hyperparameters as a frozen
dataclass deriving from `Settings`, next to its builder (e.g.
`processes.fedavg.FedAvgSettings`), with each field made by `setting(default,
help)`. Everything else derives from it: the builder takes it, the training
binary generates one flag per field (grouped by algorithm in `--helpfull`), a
`--config` TOML file and the bench suites use the field names as keys, and a
run's `config.json` records it.

One name, one meaning: a field name that several algorithms share means the
same thing in each (same help text; the defaults may differ where the papers
differ). The shared groups below (`ClientSGD`, `LocalTraining`,
`ServerSGD`) are mixed into the algorithms that use them.

`validate()` raises `SettingsError` with a one-line message on the first value
that cannot run; subclasses extend `_checks`.
"""

import collections
import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any


class SettingsError(ValueError):
    """A setting that cannot run; the message is one line."""


def setting(default: Any, help: str) -> Any:  # noqa: A002 - `help` as in absl's flags
    """A settings field: its default and the one line that explains it.

    Args:
      default: the default value (tuples for sequences: the dataclasses are
        frozen and hashable).
      help: one line for `--helpfull` and the docs; the paper's symbol first
        where it has one (`'lambda, the imitation parameter'`).

    Returns:
      A `dataclasses.field` carrying `help` in its metadata.
    """
    return dataclasses.field(default=default, metadata={'help': help})


def help_of(field: dataclasses.Field) -> str:
    """The help line of a settings field.

    Args:
      field: a field of a `Settings` dataclass.

    Returns:
      Its help text ('' when the field was not made by `setting`).
    """
    return field.metadata.get('help', '')


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Base of every settings dataclass: conversion, type checks, validation."""

    def _checks(self) -> list[tuple[bool, str]]:
        """`(ok, message)` pairs; subclasses add theirs to `super()._checks()`.

        Returns:
          The checks of this class and its bases.
        """
        return []

    def validate(self):
        """Checks every value; returns self.

        Returns:
          This settings object.

        Raises:
          SettingsError: on the first value of the wrong type or out of range.
        """
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            _check_type(field.name, getattr(self, field.name), hints[field.name])
        for ok, message in self._checks():
            _check(ok, message)
        return self

    @classmethod
    def field_names(cls) -> list[str]:
        """The names of the fields, in declaration order.

        Returns:
          The field names.
        """
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = ''):
        """Builds settings from `name -> value` (TOML, JSON, flags), coercing types.

        Lists become tuples and integers become floats where the field wants
        them; any other mismatch, or an unknown name, is an error.

        Args:
          values: a subset of the fields; the others keep their defaults.
          where: prefix of error messages (e.g. the file name).

        Returns:
          The (not yet validated) settings.

        Raises:
          SettingsError: an unknown name or a value of the wrong type.
        """
        hints = typing.get_type_hints(cls)
        known = set(cls.field_names())
        kwargs = {}
        for name, value in values.items():
            if name not in known:
                raise SettingsError(f'{where}{name} is not a setting of {cls.__name__}')
            kwargs[name] = coerce(name, value, hints[name], where)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """`name -> value` with tuples as lists: what `config.json` records.

        Returns:
          A JSON-ready dict, in field order.
        """
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def plain(value: Any) -> Any:
    """`value` with tuples (nested too) as lists, for JSON and TOML.

    Args:
      value: a settings value.

    Returns:
      The same value, tuples turned into lists.
    """
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


def _type_name(hint) -> str:
    origin = typing.get_origin(hint)
    if origin is tuple:
        element = typing.get_args(hint)[0]
        return 'a list of ' + {int: 'integers', float: 'numbers', str: 'strings'}.get(element, str(element))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return f'{_type_name(args[0])} or unset'
    return {int: 'an integer', float: 'a number', str: 'a string', bool: 'true or false'}.get(hint, str(hint))


def coerce(name: str, value: Any, hint, where: str = '') -> Any:
    """`value` as the type `hint` of field `name` wants, or SettingsError.

    Args:
      name: the field name, for the message.
      value: a value from TOML, JSON or a flag.
      hint: the field's type (`int`, `float`, `str`, `bool`, `tuple[X, ...]`,
        `X | None`).
      where: prefix of error messages.

    Returns:
      The converted value.

    Raises:
      SettingsError: when `value` cannot be that type.
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in typing.get_args(hint) if a is not type(None)][0]
        return coerce(name, value, inner, where)
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise SettingsError(f'{where}{name} must be {_type_name(hint)}, got {value!r}')
        inner = typing.get_args(hint)[0]
        return tuple(coerce(name, v, inner, where) for v in value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise SettingsError(f'{where}{name} must be {_type_name(hint)}, got {value!r}')
    return value


def _check_type(name: str, value: Any, hint) -> None:
    if value is None and _optional(hint):
        return
    if isinstance(value, list) and typing.get_origin(_inner_type(hint)) is tuple:
        raise SettingsError(f'{name} must be a tuple (settings are frozen), got {value!r}')
    try:
        ok = coerce(name, value, hint) == value
    except SettingsError:
        ok = False
    _check(ok, f'{name} must be {_type_name(hint)}, got {value!r}')


def _inner_type(hint):
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(hint) if a is not type(None)][0]
    return hint


def _optional(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


class TrainingConfig(
    collections.namedtuple('TrainingConfig', ['epochs', 'batch_size', 'learning_rate', 'max_steps'], defaults=[None])
):
    """Local SGD settings: passes over the data, batch size, step size, and an
    optional cap on the number of steps (e.g. "20 local steps")."""

    def validate(self) -> 'TrainingConfig':
        """Returns self, or raises ValueError naming the bad field.

        Returns:
          This `TrainingConfig`, unchanged.

        Raises:
          ValueError: if `epochs`, `batch_size` or `max_steps` (when set) is not
            a positive integer, or `learning_rate` is not positive.
        """
        if int(self.epochs) != self.epochs or self.epochs < 1:
            raise ValueError(f'local epochs must be a positive integer, got {self.epochs}')
        if int(self.batch_size) != self.batch_size or self.batch_size < 1:
            raise ValueError(f'batch size must be a positive integer, got {self.batch_size}')
        if not self.learning_rate > 0:
            raise ValueError(f'learning rate must be positive, got {self.learning_rate}')
        if self.max_steps is not None and (int(self.max_steps) != self.max_steps or self.max_steps < 1):
            raise ValueError(f'local steps must be a positive integer, got {self.max_steps}')
        return self


@dataclasses.dataclass(frozen=True)
class ClientSGD(Settings):
    """Plain SGD on a client's private data: batch size and step size."""

    batch_size: int = setting(10, 'B, the local mini-batch size.')
    client_learning_rate: float = setting(0.05, 'eta, the client SGD learning rate.')

    def _checks(self):
        return super()._checks() + [
            (self.batch_size >= 1, f'batch_size must be >= 1, got {self.batch_size}'),
            (self.client_learning_rate > 0, f'client_learning_rate must be > 0, got {self.client_learning_rate}'),
        ]


@dataclasses.dataclass(frozen=True)
class LocalTraining(ClientSGD):
    """Local training per round: epochs, or a fixed number of SGD steps."""

    local_epochs: int = setting(1, 'E, local epochs per round.')
    local_steps: int = setting(0, 'Local SGD steps per round instead of epochs (0: use local_epochs).')

    def _checks(self):
        return super()._checks() + [
            (self.local_epochs >= 1, f'local_epochs must be >= 1, got {self.local_epochs}'),
            (self.local_steps >= 0, f'local_steps must be >= 0, got {self.local_steps}'),
            (
                # local_steps replaces the epochs: a local_epochs other than the
                # algorithm's default would be ignored, so it is refused.
                self.local_steps == 0 or self.local_epochs == type(self).__dataclass_fields__['local_epochs'].default,
                f'give local_epochs or local_steps, not both (local_epochs={self.local_epochs}, '
                f'local_steps={self.local_steps})',
            ),
        ]

    def training_config(self) -> TrainingConfig:
        """The local work as a `TrainingConfig`.

        Returns:
          `local_steps` steps exactly when it is set (enough epochs for them,
          capped at that many steps), else `local_epochs` epochs; with
          `batch_size` and `client_learning_rate`.
        """
        if self.local_steps:
            return TrainingConfig(
                self.local_steps, self.batch_size, self.client_learning_rate, max_steps=self.local_steps
            )
        return TrainingConfig(self.local_epochs, self.batch_size, self.client_learning_rate)


@dataclasses.dataclass(frozen=True)
class ServerSGD(Settings):
    """The server's step on the aggregated update (FedAvg's server optimizer)."""

    server_learning_rate: float = setting(1.0, 'eta_g, the server SGD learning rate (1: plain averaging).')

    def _checks(self):
        return super()._checks() + [
            (self.server_learning_rate > 0, f'server_learning_rate must be > 0, got {self.server_learning_rate}'),
        ]

    def server_optimizer(self):
        """TFF's SGD with the server learning rate.

        Returns:
          A `tff.learning.optimizers.Optimizer`.
        """
        import tensorflow_federated as tff

        return tff.learning.optimizers.build_sgdm(learning_rate=self.server_learning_rate)
