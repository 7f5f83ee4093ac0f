"""Flags generated from the settings dataclasses, and the run configuration they give.

One flag per field: the run's settings (`run_config.ExperimentConfig` and its
parts, `config_parts`) and every algorithm's settings (`processes/<algo>.py`), named like the fields.
Every generated flag defaults to "unset": a run takes the dataclass default
for a flag it was not given, so the command line cannot hold a default of
its own. In `--helpfull` the flags are grouped by the class that declares
them (the run's own settings, each part of it, the partitions' settings, the
shared local-training groups, then each algorithm), each with its default(s) and the algorithms that use it.

`config_from_flags()` layers, later wins: the dataclass defaults, a
`--config` file (TOML or JSON, the flat form of `config.json`), the flags
given. A flag or file key that the chosen algorithm does not have is refused
(`--kd_mu1 does not apply to fedavg`).
"""

import json
import os
import time
import tomllib
import types
import typing

from absl import flags

from tff_pfl import settings as settings_lib
from tff_pfl.program import algorithms, run_config

_COMMON_GROUP = 'the run (tff_pfl/program/run_config.py ExperimentConfig)'


def _part_group(part: str | None) -> str:
    """The `--helpfull` group of a part's flags."""
    if part is None:
        return _COMMON_GROUP
    if part == 'partition':
        return "the partition's settings (tff_pfl/program/config_parts.py, one type per partition)"
    return f'{part} (tff_pfl/program/config_parts.py {run_config.PARTS[part].__name__})'


def _declaring_class(settings_cls: type, name: str) -> type:
    """The most basic class of `settings_cls`'s MRO that declares field `name`."""
    for cls in reversed(settings_cls.__mro__):
        if name in cls.__dict__.get('__annotations__', {}):
            return cls
    raise KeyError(name)


def _inner(hint):
    """`X` for `X | None`, else `hint`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(hint) if a is not type(None)][0]
    return hint


def _format(value) -> str:
    if isinstance(value, tuple):
        return ','.join(_format(v) for v in value) or '(empty)'
    if isinstance(value, float):
        return f'{value:g}'
    return str(value)


def _define(name: str, hint, help_text: str, group: str) -> None:
    hint = _inner(hint)
    if hint is bool:
        flags.DEFINE_boolean(name, None, help_text, module_name=group)
        return
    if typing.get_origin(hint) is tuple:
        parser, serializer = flags.ListParser(), flags.CsvListSerializer(',')
    else:
        parser = {int: flags.IntegerParser(), float: flags.FloatParser(), str: flags.ArgumentParser()}[hint]
        serializer = None
    flags.DEFINE(parser, name, None, help_text, serializer=serializer, module_name=group)


def setting_groups() -> dict[str, list[tuple[str, type, str]]]:
    """Every generated flag, grouped as in `--helpfull`.

    Returns:
      group title -> `[(flag name, type hint, help with defaults)]`: the
      run's own settings, one group per part of the run's configuration
      and one for the partitions' settings first, then one group per class that declares
      algorithm settings (a shared group such as `LocalTraining`, or an
      algorithm's own class), titled with the algorithms that use it.
    """
    groups = {_COMMON_GROUP: []}
    for part, name, hint, help_line, default in run_config.ExperimentConfig.common_settings():
        text = help_line if part == 'partition' else f'{help_line} (default: {_format(default)})'
        groups.setdefault(_part_group(part), []).append((name, hint, text))
    seen = set()
    for algorithm in algorithms.names():
        settings_cls = algorithms.get(algorithm).settings
        class_hints = typing.get_type_hints(settings_cls)
        for field in settings_cls.__dataclass_fields__.values():
            if field.name in seen:
                continue
            seen.add(field.name)
            owner = _declaring_class(settings_cls, field.name)
            users = algorithms.users_of(field.name)
            title = f'{owner.__name__} ({owner.__module__}): {", ".join(users)}'
            by_default = {}
            for user in users:
                value = getattr(algorithms.get(user).settings(), field.name)
                by_default.setdefault(_format(value), []).append(user)
            if len(by_default) == 1:
                shown = next(iter(by_default))
            else:
                shown = '; '.join(f'{value} for {", ".join(names)}' for value, names in by_default.items())
            groups.setdefault(title, []).append(
                (field.name, class_hints[field.name], f'{settings_lib.help_of(field)} (default: {shown})')
            )
    return groups


def define_flags() -> None:
    """Defines one absl flag per setting (see the module docstring) and `--config`."""
    for group, entries in setting_groups().items():
        for name, hint, text in entries:
            _define(name, hint, text, group)
    flags.DEFINE_string(
        'config',
        None,
        'A TOML or JSON file of settings in the flat form of config.json (common and algorithm settings side by '
        'side, as one entry of a bench suite); flags given on the command line win.',
        module_name=_COMMON_GROUP,
    )


def _from_flag(name: str, raw, hint):
    """A flag's parsed value as the settings type wants it (lists of numbers, ...)."""
    inner = _inner(hint)
    if typing.get_origin(inner) is tuple:
        element = typing.get_args(inner)[0]
        try:
            return tuple(element(v) for v in raw)
        except ValueError:
            kind = 'numbers' if element in (int, float) else 'values'
            raise run_config.ConfigError(f'--{name} must be {kind}, got {",".join(raw)}') from None
    return raw


def read_config_file(path: str) -> dict:
    """The flat settings of a `--config` file.

    Args:
      path: a `.toml` or `.json` file.

    Returns:
      `name -> value`.

    Raises:
      run_config.ConfigError: unreadable, not TOML/JSON, or not a flat table.
    """
    try:
        with open(path, 'rb') as f:
            raw = f.read()
    except OSError as e:
        raise run_config.ConfigError(f'--config: cannot read {path}: {e.strerror}') from None
    try:
        if path.endswith('.json'):
            values = json.loads(raw)
        else:
            values = tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise run_config.ConfigError(
            f'--config: {path} is not valid {"JSON" if path.endswith(".json") else "TOML"}: {str(e).splitlines()[0]}'
        ) from None
    if not isinstance(values, dict) or any(isinstance(v, dict) for v in values.values()):
        raise run_config.ConfigError(f'--config: {path} must be a flat table of settings (name = value)')
    return run_config.migrate(values)


def config_from_flags() -> run_config.ExperimentConfig:
    """The validated run configuration from the parsed flags (and `--config`).

    Returns:
      The validated `run_config.ExperimentConfig`; `output_dir` defaults to
      `runs/<algorithm>-<time>`.

    Raises:
      run_config.ConfigError: a flag or file key that does not apply to the
        algorithm, or a value the configuration refuses.
    """
    values = {}
    path = flags.FLAGS['config'].value
    if path:
        values.update(read_config_file(path))
    common_hints = {name: hint for _, name, hint, _, _ in run_config.ExperimentConfig.common_settings()}
    given = {}
    for name in run_config.ExperimentConfig.common_fields():
        if flags.FLAGS[name].present:
            given[name] = _from_flag(name, flags.FLAGS[name].value, common_hints[name])
    values.update(given)
    algorithm = values.get('algorithm', 'fedavg')
    settings_cls = run_config.declaration(algorithm).settings
    own = set(settings_cls.field_names())
    hints = typing.get_type_hints(settings_cls)
    for name in sorted(algorithms.all_setting_names()):
        if not flags.FLAGS[name].present:
            continue
        if name not in own:
            users = ', '.join(algorithms.users_of(name))
            raise run_config.ConfigError(f'--{name} does not apply to {algorithm} (it is a setting of {users})')
        values[name] = _from_flag(name, flags.FLAGS[name].value, hints[name])
    output_dir = flags.FLAGS['output_dir'].value or values.get('output_dir')
    values['output_dir'] = output_dir or os.path.join('runs', f'{algorithm}-{time.strftime("%Y%m%d-%H%M%S")}')
    where = f'--config {path}: ' if path else ''
    return run_config.ExperimentConfig.from_dict(values, where=where).validate()


_DOC_INTRO = """# Settings

Generated from the settings dataclasses by `uv run --locked python -m tff_pfl.cli.config_flags >
docs/settings.md`; a test keeps this page equal to that output. Each algorithm's settings are one
frozen dataclass next to its builder in `processes/<algo>.py`, the only place their defaults are
written. The run's own settings are `tff_pfl.program.run_config.ExperimentConfig` (the algorithm,
its model, the seed) and its named parts in `tff_pfl.program.config_parts`: `data` (the source and
its partition, one settings type per partition), `schedule` (rounds and sampling), `evaluation`,
`checkpoints`, `privacy` and `runtime`; in Python, `config.schedule.rounds`, `config.data.partition`.

A run's configuration is the run's settings plus the chosen algorithm's. It is layered, later
wins: the dataclass defaults, a `--config` file (TOML or JSON, flat `name = value` pairs: the
form of `config.json`, and of one entry of a bench suite), then the flags given. The flat form
puts every part's fields side by side under their own names (no two parts share a name). A flag
or file key the chosen algorithm does not have is refused in one line (`--kd_mu1 does not apply
to fedavg`), and so is a partition setting the chosen partition does not take. `config.json`
records exactly the run's settings and the algorithm's, so `--config=<run>/config.json` reruns a
run; resuming compares exactly those.

One name, one meaning: a flag shared by several algorithms, or by several partitions, means the
same in each (the defaults may differ, as the papers do; each table says which has which).
"""


def markdown() -> str:
    """docs/settings.md: every flag of every group, with defaults and meaning.

    Returns:
      The page's text, ending with a newline.
    """
    lines = [_DOC_INTRO]
    for group, entries in setting_groups().items():
        lines += [f'## {group}', '', '| flag | meaning (default) |', '|---|---|']
        lines += [f'| `--{name}` | {text.replace("|", "/")} |' for name, _, text in entries]
        lines.append('')
    return '\n'.join(lines)


if __name__ == '__main__':
    print(markdown(), end='')
