"""The run's configuration in named parts: each flat name has one home, the flat form round-trips."""

import dataclasses
import inspect
import json
import re

import pytest

from tff_pfl import settings as settings_lib
from tff_pfl.data import partition, partition_registry
from tff_pfl.program import algorithms, config_parts, run_config


def test_every_flat_name_lives_in_one_place():
    """The flat form is the parts' fields side by side: none is missing, none is in two parts."""
    flat = run_config.ExperimentConfig.common_fields()
    assert len(flat) == len(set(flat))
    homes = {}
    for part, cls in run_config.PARTS.items():
        for name in cls.field_names():
            homes.setdefault(name, []).append(part)
    for name in ('algorithm', 'model', 'model_modules', 'seed'):
        homes.setdefault(name, []).append('top')
    for name in config_parts.PARTITION_SETTINGS:
        homes.setdefault(name, []).append('partition')
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}
    every_partition_setting = {n for cls in config_parts.PARTITIONS.values() for n in cls.field_names()}
    assert set(config_parts.PARTITION_SETTINGS) == every_partition_setting
    assert set(homes) == set(flat)
    assert not set(flat) & algorithms.all_setting_names()


def test_each_partition_setting_means_one_thing():
    """A setting several partitions take has one type; the flag's help says what each partition does with it."""
    for name in config_parts.PARTITION_SETTINGS:
        users = config_parts.partition_users(name)
        kinds = {
            str(
                dataclasses.fields(config_parts.PARTITIONS[u])[
                    config_parts.PARTITIONS[u].field_names().index(name)
                ].type
            )
            for u in users
        }
        assert len(kinds) == 1, (name, kinds)
    assert config_parts.partition_users('shards_per_client') == ['shards']
    assert 'shards' not in config_parts.partition_users('classes_per_client')


@pytest.mark.parametrize('partition', list(config_parts.PARTITIONS))
def test_flat_form_round_trips_through_json_for_every_partition(partition):
    cls = config_parts.PARTITIONS[partition]
    values = {}
    for field in dataclasses.fields(cls):
        values[field.name] = {'kd_split_sizes': [5, 9, 3, 4], 'kt_case1_counts': [7, 2]}.get(field.name, 3)
        if field.name == 'dirichlet_alpha':
            values[field.name] = 0.5
    config = run_config.make_config(output_dir='x', partition=partition, rounds=4, dp_noise_multiplier=0.5, **values)
    assert type(config.data.partition) is cls and config.data.partition.name == partition
    assert config.schedule.rounds == 4 and config.privacy.dp_noise_multiplier == 0.5
    flat = json.loads(json.dumps(config.to_dict()))
    assert list(flat)[: len(run_config.ExperimentConfig.common_fields()) + 1] == [
        'output_dir',
        *run_config.ExperimentConfig.common_fields(),
    ]
    # The settings of the other partitions are written as null, as config.json always had them.
    assert all(flat[n] is None for n in config_parts.PARTITION_SETTINGS if n not in values)
    assert run_config.ExperimentConfig.from_dict(flat) == config


def test_a_partition_setting_the_partition_does_not_take_is_refused_in_one_line():
    with pytest.raises(run_config.ConfigError, match=r'^--examples_per_class does not apply to partition ds1$'):
        run_config.make_config(output_dir='x', partition='ds1', examples_per_class=3)
    with pytest.raises(
        run_config.ConfigError, match='^--classes_per_client does not apply to partition shards: its setting is'
    ):
        run_config.make_config(output_dir='x', partition='shards', classes_per_client=3)
    with pytest.raises(run_config.ConfigError, match=r"^unknown partition 'ds9'; known: ds1, "):
        run_config.make_config(output_dir='x', partition='ds9')
    # Null (as config.json writes a setting of another partition) is no setting.
    assert run_config.make_config(output_dir='x', partition='iid', examples_per_class=None).data.partition == (
        config_parts.IidPartition()
    )


def test_replace_changes_settings_by_their_flat_names():
    config = run_config.make_config(output_dir='x', algorithm='persfl', partition='ds1', classes_per_client=3)
    changed = config.replace(rounds=5, eval_every=2, dp_clip=1.0, examples_per_client=40, distill_epochs=2)
    assert changed.schedule.rounds == 5 and changed.evaluation.eval_every == 2 and changed.privacy.dp_clip == 1.0
    assert changed.data.partition == config_parts.Ds1Partition(classes_per_client=3, examples_per_client=40)
    assert changed.settings.distill_epochs == 2 and changed.settings.temperatures == config.settings.temperatures
    assert config.schedule.rounds == 100  # frozen: a new configuration
    moved = config.replace(partition='shards', shards_per_client=4)
    assert moved.data.partition == config_parts.ShardsPartition(shards_per_client=4)
    assert moved.replace(algorithm='fedavg').settings == algorithms.get('fedavg').settings()
    with pytest.raises(run_config.ConfigError, match='^--classes_per_client does not apply to partition shards'):
        moved.replace(classes_per_client=2)
    with pytest.raises(run_config.ConfigError, match="^unknown setting 'kd_mu1' for persfl$"):
        config.replace(kd_mu1=1.0)


def test_make_config_takes_a_settings_object_or_names_but_not_both():
    settings = algorithms.get('ditto').settings(ditto_lambda=0.3)
    config = run_config.make_config(output_dir='x', algorithm='ditto', rounds=3, settings=settings)
    assert config.settings is settings and config.schedule.rounds == 3
    with pytest.raises(run_config.ConfigError, match='^make_config: ditto_lambda is given by name and in settings'):
        run_config.make_config(output_dir='x', algorithm='ditto', ditto_lambda=0.1, settings=settings)


def test_parts_are_checked_in_one_line_and_by_type():
    for values, message in (
        ({'rounds': 0}, 'rounds must be >= 1, got 0'),
        ({'eval_every': -1}, 'eval_every must be >= 0, got -1'),
        ({'checkpoint_every': -2}, 'checkpoint_every must be >= 0, got -2'),
        ({'max_concurrent_clients': 0}, 'max_concurrent_clients must be >= 1 or -1, got 0'),
        ({'rounds_per_call': 0}, 'rounds_per_call must be >= 1, got 0'),
        ({'partition': 'ds1', 'classes_per_client': 0}, 'classes_per_client must be >= 1, got 0'),
        ({'partition': 'ds2', 'dirichlet_alpha': 0.0}, 'dirichlet_alpha must be > 0, got 0.0'),
        (
            {'partition': 'kd_dirichlet', 'kd_split_sizes': (9, 3, 1, 1)},
            'kd_split_sizes must be min_train <= max_train',
        ),
        (
            {'split_fractions': (0.5, 0.5)},
            'split_fractions must be three numbers summing to 1, train and test positive',
        ),
    ):
        with pytest.raises(run_config.ConfigError, match=f'^{message}'):
            run_config.make_config(output_dir='x', **values).validate()
    config = run_config.make_config(output_dir='x')
    with pytest.raises(run_config.ConfigError, match='^schedule must be a config_parts.ScheduleConfig, got'):
        dataclasses.replace(config, schedule=config.evaluation).validate()


def test_a_config_json_of_the_previous_layout_resumes_as_the_same_configuration():
    """config.json as runs wrote it before the parts: every partition setting present, null where unused."""
    written = {
        'output_dir': 'runs/x',
        'algorithm': 'fedavg',
        'dataset': 'synthetic',
        'data_dir': None,
        'download': False,
        'partition': 'ds1',
        'num_clients': 8,
        'classes_per_client': 3,
        'shards_per_client': None,
        'dirichlet_alpha': None,
        'examples_per_client': None,
        'examples_per_class': None,
        'base_examples_per_class': None,
        'kt_case1_counts': None,
        'kd_split_sizes': None,
        'split_fractions': [0.6, 0.2, 0.2],
        'model': None,
        'model_modules': [],
        'rounds': 7,
        'client_fraction': 1.0,
        'eval_every': 10,
        'eval_clients': 0,
        'checkpoint_every': 10,
        'seed': 0,
        'stop_on_divergence': True,
        'dp_noise_multiplier': None,
        'dp_clip': None,
        'dp_target_quantile': None,
        'dp_initial_clip': None,
        'dp_delta': None,
        'dp_target_epsilon': None,
        'secure_aggregation': False,
        'max_concurrent_clients': 2,
        'workers': [],
    }
    config = run_config.ExperimentConfig.from_dict(written)
    flat = json.loads(json.dumps(config.to_dict()))
    own = {k: v for k, v in flat.items() if k in config.settings.field_names()}
    # Settings added since (the mutual-TLS files, then the rounds a call, last; the validation curve
    # beside the other evaluation settings) are written with their defaults.
    added = {**{name: None for name in config_parts.WORKER_TLS_SETTINGS}, 'rounds_per_call': 1}
    assert {k: v for k, v in flat.items() if k not in own} == {**written, **added, 'eval_validation': False}
    listed = [k for k in flat if k not in own]
    assert [k for k in listed if k != 'eval_validation'] == [*written, *added]  # and in the same order
    assert listed[listed.index('eval_clients') + 1] == 'eval_validation'
    assert config.data.partition.params() == {'k': 3}


@pytest.mark.parametrize('name', [n for n in config_parts.PARTITIONS if n != 'natural'])
def test_each_partition_type_names_its_partitioners_arguments_and_their_defaults(name):
    """params() are keyword arguments of the partitioner; each help line's default is the partitioner's."""
    cls = config_parts.PARTITIONS[name]
    signature = inspect.signature(partition_registry.partitioner(name))
    for field in dataclasses.fields(cls):
        kwargs = cls._params[field.name]
        kwargs = kwargs if isinstance(kwargs, tuple) else (kwargs,)
        assert set(kwargs) <= set(signature.parameters), (field.name, kwargs)
        defaults = [cls._fixed.get(k, signature.parameters[k].default) for k in kwargs]
        said = re.search(r'\(default ([0-9.,]+)\)', settings_lib.help_of(field))
        if said is None and '(required)' in settings_lib.help_of(field):
            assert defaults == [inspect.Parameter.empty], (field.name, defaults)
            with pytest.raises(run_config.ConfigError, match=f'^partition {name} needs --{field.name}$'):
                run_config.make_config(output_dir='x', partition=name).validate()
        elif said is None:  # 'as many as fit': the partitioner's None
            assert defaults == [None], (field.name, defaults)
        else:
            assert [float(v) for v in said.group(1).split(',')] == [float(d) for d in defaults], field.name
    assert set(cls._params) == set(cls.field_names())


def test_the_partitions_are_the_partitioners_and_natural():
    for name in config_parts.PARTITIONS:
        if name != 'natural':
            partition_registry.partitioner(name)
    with pytest.raises(partition.PartitionError):
        partition_registry.partitioner('natural')


def test_a_run_recorded_before_the_validation_curve_resumes_as_the_same_configuration():
    """A config.json without `eval_validation` means False: the run continues; True is another configuration."""
    from tff_pfl.program import experiment

    config = run_config.make_config(output_dir='runs/x', algorithm='fedavg').validate()
    saved = json.loads(json.dumps(config.to_dict()))
    del saved['eval_validation']
    assert experiment._changed_fields(saved, config) == []
    curved = run_config.make_config(output_dir='runs/x', algorithm='fedavg', eval_validation=True).validate()
    assert experiment._changed_fields(saved, curved) == ['eval_validation: False -> True']
