"""One source of truth for settings: the dataclasses, the flags, config files, config.json."""

import dataclasses
import json
import os
import subprocess
import sys
import typing

import pytest

from tff_pfl import settings as settings_lib
from tff_pfl.cli import config_flags
from tff_pfl.program import algorithms, run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = algorithms.names()


@pytest.fixture
def parse(capsys):
    """Parses a command line of tff-pfl-train in this process; returns its configuration."""
    from absl import flags as absl_flags

    from tff_pfl.cli import common, train

    del train  # defines the flags

    def run(*argv):
        absl_flags.FLAGS.unparse_flags()
        common.flags_parser('tff-pfl-train')(['tff-pfl-train', *argv])
        return config_flags.config_from_flags()

    yield run
    absl_flags.FLAGS.unparse_flags()


@pytest.mark.parametrize('algorithm', ALGORITHMS)
def test_command_line_defaults_are_the_dataclass_defaults(algorithm, parse):
    config = parse(f'--algorithm={algorithm}', '--output_dir=x')
    settings_cls = algorithms.get(algorithm).settings
    assert type(config.settings) is settings_cls
    assert config.settings == settings_cls()
    api = run_config.ExperimentConfig(output_dir='x', algorithm=algorithm)
    assert config == api
    assert api.settings == settings_cls()


@pytest.mark.parametrize('algorithm', ALGORITHMS)
def test_every_settings_type_is_a_frozen_dataclass_next_to_its_builder_and_valid_by_default(algorithm):
    settings_cls = algorithms.get(algorithm).settings
    assert dataclasses.is_dataclass(settings_cls) and settings_cls.__dataclass_params__.frozen
    assert settings_cls.__module__.startswith('processes.'), settings_cls.__module__
    defaults = settings_cls().validate()
    for field in dataclasses.fields(settings_cls):
        assert settings_lib.help_of(field), f'{settings_cls.__name__}.{field.name} has no help'
    # Flat form round trip: what config.json records comes back as the same settings.
    assert settings_cls.from_dict(json.loads(json.dumps(defaults.to_dict()))) == defaults


def test_one_name_one_meaning():
    """A setting shared by several algorithms has one help text (its meaning) and one type."""
    seen = {}
    for algorithm in ALGORITHMS:
        settings_cls = algorithms.get(algorithm).settings
        hints = typing.get_type_hints(settings_cls)
        for field in dataclasses.fields(settings_cls):
            meaning = (settings_lib.help_of(field), hints[field.name])
            first = seen.setdefault(field.name, (algorithm, meaning))
            assert first[1] == meaning, f'{field.name}: {first[0]} says {first[1]}, {algorithm} says {meaning}'
    common = set(run_config.ExperimentConfig.common_fields())
    assert not common & set(seen), 'an algorithm setting has the name of a common setting'


def test_a_flag_of_another_algorithm_is_refused(parse):
    with pytest.raises(run_config.ConfigError, match='--kd_mu1 does not apply to fedavg'):
        parse('--kd_mu1=2')
    with pytest.raises(run_config.ConfigError, match='--local_steps does not apply to selffl'):
        parse('--algorithm=selffl', '--local_steps=2')


def test_flags_set_the_algorithm_settings(parse):
    config = parse('--algorithm=persfl', '--distill_epochs=2', '--temperatures=1,3', '--batch_size=16')
    assert config.settings.distill_epochs == 2
    assert config.settings.temperatures == (1.0, 3.0)
    assert config.settings.batch_size == 16


def test_config_json_and_toml_files_rerun_the_same_configuration(parse, tmp_path):
    config = parse('--algorithm=ditto', '--ditto_lambda=0.5', '--rounds=7', '--output_dir=run')
    path = tmp_path / 'config.json'
    path.write_text(json.dumps(config.to_dict()))
    assert parse(f'--config={path}') == config
    toml = tmp_path / 'run.toml'
    toml.write_text('algorithm = "ditto"\nditto_lambda = 0.5\nrounds = 7\noutput_dir = "run"\n')
    assert parse(f'--config={toml}') == config
    # A flag wins over the file.
    assert parse(f'--config={toml}', '--rounds=9').schedule.rounds == 9
    toml.write_text('algorithm = "fedavg"\nditto_lambda = 0.5\n')
    with pytest.raises(run_config.ConfigError, match='ditto_lambda does not apply to fedavg'):
        parse(f'--config={toml}')
    toml.write_text('rounds = [1, 2\n')
    with pytest.raises(run_config.ConfigError, match='is not valid TOML'):
        parse(f'--config={toml}')


def test_the_partition_settings_each_mean_one_thing_and_old_files_read_the_old_name(parse, tmp_path):
    config = parse('--partition=shards', '--shards_per_client=3', '--num_clients=4')
    assert config.data.partition.params() == {'shards_per_client': 3}
    assert parse('--partition=ds1', '--classes_per_client=3').data.partition.params() == {'k': 3}
    # The old name of the shards' setting: a flag is refused, saying the new one ...
    with pytest.raises(
        run_config.ConfigError,
        match='^--classes_per_client does not apply to partition shards: its setting is --shards_per_client now$',
    ):
        parse('--partition=shards', '--classes_per_client=3')
    # ... a file written before (config.json, --config) reads as the new one.
    old = dict(config.to_dict(), classes_per_client=3)
    del old['shards_per_client']
    path = tmp_path / 'config.json'
    path.write_text(json.dumps(old))
    assert parse(f'--config={path}') == config
    today = config.to_dict()
    assert run_config.migrate(old) == {k: v for k, v in today.items() if k != 'classes_per_client'}
    assert run_config.migrate(today) == today
    assert run_config.migrate({'partition': 'ds1', 'classes_per_client': 3}) == {
        'partition': 'ds1',
        'classes_per_client': 3,
    }


def test_an_old_run_directory_of_the_shards_partition_still_resumes(tmp_path):
    from tff_pfl.program import experiment

    config = run_config.make_config(
        output_dir=str(tmp_path / 'run'), partition='shards', shards_per_client=2, num_clients=4
    ).validate()
    os.makedirs(config.output_dir)
    old = dict(config.to_dict(), classes_per_client=2)
    del old['shards_per_client']
    with open(os.path.join(config.output_dir, 'config.json'), 'w') as f:
        json.dump(old, f)
    # Same run: no field changed (a checkpoint would be resumed); another value: not resumable.
    assert experiment._changed_fields(experiment._saved_config(config.output_dir), config) == []
    other = run_config.make_config(
        output_dir=config.output_dir, partition='shards', shards_per_client=3, num_clients=4
    ).validate()
    assert experiment._changed_fields(experiment._saved_config(config.output_dir), other) == [
        'shards_per_client: 2 -> 3'
    ]


def test_config_json_records_only_the_algorithm_settings_that_apply():
    flat = run_config.ExperimentConfig(output_dir='x', algorithm='fedavg').to_dict()
    assert 'kd_mu1' not in flat and 'distill_epochs' not in flat
    assert set(flat) == {
        'output_dir',
        *run_config.ExperimentConfig.common_fields(),
        *algorithms.get('fedavg').settings.field_names(),
    }


def test_helpfull_groups_the_flags_by_algorithm():
    groups = config_flags.setting_groups()
    titles = '\n'.join(groups)
    for algorithm in ALGORITHMS:
        assert algorithm in titles
    names = [name for entries in groups.values() for name, _, _ in entries]
    assert len(names) == len(set(names))
    assert set(names) == set(run_config.ExperimentConfig.common_fields()) | algorithms.all_setting_names()


def test_docs_settings_page_is_generated_from_the_dataclasses():
    with open(os.path.join(REPO, 'docs', 'settings.md')) as f:
        assert f.read() == config_flags.markdown(), (
            'rerun: uv run python -m tff_pfl.cli.config_flags > docs/settings.md'
        )


def test_helpfull_lists_the_generated_groups():
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    result = subprocess.run(
        [sys.executable, '-m', 'tff_pfl.cli.train', '--helpfull'],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode in (0, 1), result.stderr[-2000:]
    for title in config_flags.setting_groups():
        assert f'{title}:' in result.stdout, title
