"""Exported computations, read back by deploy/loader.py and run piece by piece, equal the in-process rounds."""

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_federated as tff

from deploy import loader
from tff_pfl import models
from tff_pfl.computations import device_state
from tff_pfl.program import algorithms, export, run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Small settings for speed, each given to the algorithms that have it.
_SMALL = dict(
    batch_size=16, temperatures=(1.0, 5.0), imitations=(0.0, 0.5), distill_epochs=1, finetune_epochs=2, local_epochs=1
)


def _small(algorithm):
    own = algorithms.get(algorithm).settings.field_names()
    return {k: v for k, v in _SMALL.items() if k in own}


def _config(out, algorithm, **kwargs):
    return run_config.make_config(
        output_dir=str(out), algorithm=algorithm, dataset='synthetic', num_clients=4, **_small(algorithm), **kwargs
    )


@pytest.fixture(scope='module')
def exports(tmp_path_factory):
    """algorithm -> (export directory, config), exported once per module."""
    root = tmp_path_factory.mktemp('exports')
    done = {}
    for algorithm in ('fedavg', 'persfl', 'local', 'feddf', 'ktpfl', 'ktpfl_homo', 'kdpdfl'):
        extra = {'partition': 'iid'} if algorithm in ('feddf', 'ktpfl', 'ktpfl_homo') else {}
        if algorithm in ('feddf', 'ktpfl'):
            extra['public_examples'] = 40
        if algorithm in ('feddf', 'ktpfl'):
            extra['architectures'] = ('logistic', 'mnist_dnn')
        if algorithm == 'kdpdfl':
            extra['partition'] = 'iid'
        config = _config(root / algorithm, algorithm, **extra)
        export.export(config, log=lambda line: None)
        done[algorithm] = (str(root / algorithm), config)
    # FedAvg with its uploads summed by secure sums (federated_secure_sum_bitwidth).
    config = _config(root / 'fedavg_secure', 'fedavg', secure_aggregation=True)
    export.export(config, log=lambda line: None)
    done['fedavg_secure'] = (str(root / 'fedavg_secure'), config)
    # DP records through secure sums (noise multiplier 0, so that both rounds can be compared bit for bit).
    private = {'dp_noise_multiplier': 0.0, 'dp_clip': 10.0, 'secure_aggregation': True}
    for name, algorithm, extra in [
        ('selffl_dp_secure', 'selffl', {}),
        (
            'feddf_dp_secure',
            'feddf',
            {'partition': 'iid', 'public_examples': 40, 'architectures': ('logistic', 'mnist_dnn')},
        ),
    ]:
        config = _config(root / name, algorithm, **private, **extra)
        export.export(config, log=lambda line: None)
        done[name] = (str(root / name), config)
    return done


def _in_process(export_dir, config):
    """The same algorithm built in process, on the export's own client data."""
    with open(os.path.join(export_dir, 'manifest.json')) as f:
        root = json.load(f)['client_data_root']
    from tff_pfl.data import client_data

    spec = client_data.load_client_data_spec(root)
    model_fn = functools.partial(models.get(config.model_name()), spec.feature_shape, spec.num_classes)
    return algorithms.build(config.algorithm, config.settings, spec, model_fn, config), spec


def _flat(value):
    return [np.asarray(x) for x in tff.structure.flatten(tff.structure.from_container(value, recursive=True))]


def _assert_server_state(in_process, exported):
    """Equal on the in-process state's fields (KT-pFL's device form also carries its targets)."""
    if set(exported) - set(in_process):
        exported = {k: exported[k] for k in in_process}
    _assert_equal(in_process, exported)


def _assert_equal(a, b):
    fa, fb = _flat(a), _flat(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    'algorithm, form',
    [
        ('fedavg', 'map_reduce'),
        ('fedavg', 'distribute_aggregate'),
        ('fedavg_secure', 'map_reduce'),
        ('fedavg_secure', 'distribute_aggregate'),
        ('selffl_dp_secure', 'map_reduce'),
        ('feddf_dp_secure', 'distribute_aggregate'),
        ('persfl', 'map_reduce'),
        ('persfl', 'distribute_aggregate'),
        ('local', 'map_reduce'),
        ('feddf', 'distribute_aggregate'),
        ('ktpfl', 'map_reduce'),
        ('ktpfl_homo', 'distribute_aggregate'),
    ],
)
def test_exported_round_step_by_step_equals_the_in_process_round(algorithm, form, exports, tmp_path, tff_runtime):
    export_dir, config = exports[algorithm]
    exported = loader.Export(export_dir)
    run_round = getattr(exported, f'run_round_{form}')
    process, spec = _in_process(export_dir, config)
    ids = list(spec.client_ids)
    states = {c: process.initial_client_state(c) for c in ids}
    devices = dict(zip(ids, exported.device_inputs(str(tmp_path / 'states'))))
    os.makedirs(tmp_path / 'states')
    state = process.initialize()
    exported_state = exported.initialize()
    _assert_server_state(state, exported_state)
    for sampled in (ids, ids[1:3], ids):  # clients that skip a round keep their state
        output = process.next(state, [states[c] for c in sampled])
        states.update(zip(sampled, output.client_states))
        exported_state, metrics = run_round(exported_state, [devices[c] for c in sampled])
        _assert_server_state(output.state, exported_state)
        _assert_equal(output.metrics, metrics)
        for c in ids:
            _assert_equal(states[c], exported.load_client_state(devices[c]))
        state = output.state
    # The device's evaluation (and personalization) stages, run from the export.
    if process.personalize is not None:
        personalized = process.personalize(state, [states[c] for c in ids])
        states.update(zip(ids, personalized))
        exported.personalize(exported_state, [devices[c] for c in ids])
        for c in ids:
            _assert_equal(states[c], exported.load_client_state(devices[c]))
    evaluations = process.evaluate(state, [states[c] for c in ids])
    exported_evaluations = device_state.in_client_order(
        exported.evaluate(exported_state, [devices[c] for c in ids]), ids
    )
    _assert_equal(evaluations, exported_evaluations)


@pytest.mark.parametrize('algorithm', ['fedavg', 'persfl', 'local', 'feddf', 'ktpfl', 'ktpfl_homo'])
def test_device_form_sends_the_server_what_the_in_process_round_does(algorithm, exports):
    from tff_pfl.computations import audit

    process, spec = _in_process(*exports[algorithm])
    device = process.device

    def crossings(comps, slots=False):
        found = []
        for comp in comps:
            for uri, t in audit.clients_to_server_values(comp):
                if slots and uri == 'federated_aggregate':
                    # In process, KT-pFL's upload goes with the client's index into the server's rows; on
                    # devices, into the client's slot of an [N, ...] sum (TFF 0.87's DistributeAggregateForm
                    # cannot take a federated_aggregate): the same value, N rows of it.
                    value = t.member['value']
                    uri, t = (
                        'federated_sum',
                        tff.FederatedType(tff.TensorType(value.dtype, (spec.num_clients, *value.shape)), tff.CLIENTS),
                    )
                found.append((uri, str(t)))
        return sorted(found)

    in_process = crossings([process.next], slots=algorithm.startswith('ktpfl'))
    assert crossings(device.phases.values()) == in_process
    if algorithm.startswith('ktpfl'):
        assert in_process != crossings([process.next])
    # Neither evaluation nor personalization sends anything from the clients to the server.
    assert audit.clients_to_server_intrinsics(device.evaluate) == set()
    if device.personalize is not None:
        assert audit.clients_to_server_intrinsics(device.personalize) == set()


def test_client_work_alone_is_what_the_map_reduce_work_computes(exports, tmp_path, tff_runtime):
    exported = loader.Export(exports['persfl'][0])
    state = exported.initialize()
    form = exported.map_reduce_forms['next']
    broadcast = form.prepare(state)
    first, second = exported.device_inputs(str(tmp_path / 'a'))[0], exported.device_inputs(str(tmp_path / 'b'))[0]
    os.makedirs(tmp_path / 'a')
    os.makedirs(tmp_path / 'b')
    # The round's one federated sum: the weighted update, the weight and the metric sums together.
    (sums,) = form.work(first, broadcast)[0]
    weighted_update, weight, metric_sums = sums['weighted_update'], sums['weight'], sums['metric_sums']
    alone = exported.client_work(broadcast[0], second)['sums']  # prepare wraps the broadcast value in a 1-tuple
    # The device weighs its own update (the client side of the weighted mean), as the form's work does.
    assert weight == alone['weight']
    for product, weighted in zip(weighted_update, alone['weighted_update']):
        np.testing.assert_array_equal(product, weighted)
    _assert_equal(metric_sums, alone['metric_sums'])
    _assert_equal(exported.load_client_state(first), exported.load_client_state(second))


def test_manifest_records_types_hashes_and_versions(exports):
    export_dir, _ = exports['persfl']
    with open(os.path.join(export_dir, 'manifest.json')) as f:
        manifest = json.load(f)
    assert manifest['algorithm'] == 'persfl'
    assert manifest['versions']['tensorflow-federated'] == tff.__version__
    assert set(manifest['computations']) == {
        'initialize',
        'initial_client_state',
        'next',
        'evaluate',
        'personalize',
        'client_work',
        'client_evaluate',
        'client_personalize',
    }
    # The exported round takes device inputs and returns nothing CLIENTS-placed.
    assert manifest['computations']['next']['type_signature'].startswith('(<state=<model=<float32')
    assert '{<client_id=str,state_file=str>}@CLIENTS' in manifest['computations']['next']['type_signature']
    assert '@CLIENTS' not in manifest['computations']['next']['type_signature'].split('->')[1]
    assert manifest['phases'] == ['next']
    assert list(manifest['forms']['map_reduce_form']['phases']['next']) == list(export.MAP_REDUCE_PIECES)
    assert list(manifest['forms']['distribute_aggregate_form']['phases']['next']) == list(
        export.DISTRIBUTE_AGGREGATE_PIECES
    )


def test_ktpfl_round_is_exported_as_two_phases(exports):
    exported = loader.Export(exports['ktpfl'][0])
    assert exported.phases == ['share', 'distill']
    assert set(exported.map_reduce_forms) == set(exported.distribute_aggregate_forms) == {'share', 'distill'}
    assert {'client_work_share', 'client_work_distill'} <= set(exported.computations)
    state_type = exported.initialize.type_signature.result
    assert 'targets=float32[4,' in str(state_type)  # the server keeps the mixed targets between the phases
    for phase in exported.phases:
        signature = exported.computations[phase].type_signature
        assert signature.parameter[0].is_equivalent_to(state_type)
        assert signature.result['state'].is_equivalent_to(state_type)
    metric_names = {
        phase: [
            name
            for name, _ in tff.structure.iter_elements(
                exported.computations[phase].type_signature.result['metrics'].member
            )
        ]
        for phase in exported.phases
    }
    assert metric_names == {
        'share': ['train_loss', 'train_accuracy', 'num_examples', 'num_clients', 'mean_local_steps'],
        'distill': ['distill_kl'],
    }


def test_altered_or_foreign_exports_are_refused(exports, tmp_path):
    import shutil

    copy = tmp_path / 'copy'
    shutil.copytree(exports['fedavg'][0], copy)
    with open(copy / 'map_reduce_form' / 'next' / 'work.pb', 'ab') as f:
        f.write(b'\0')
    with pytest.raises(loader.ExportError, match='work.pb: SHA-256 differs from the manifest'):
        loader.Export(str(copy))
    manifest = json.loads((copy / 'manifest.json').read_text())
    manifest['versions']['tensorflow-federated'] = '0.1.0'
    (copy / 'manifest.json').write_text(json.dumps(manifest))
    with pytest.raises(loader.ExportError, match=f'written by TFF 0.1.0; this is TFF {tff.__version__}'):
        loader.Export(str(copy))
    with pytest.raises(loader.ExportError, match='no manifest.json'):
        loader.Export(str(tmp_path))


def test_a_round_that_does_not_fit_is_exported_without_the_forms(exports, tff_runtime):
    exported = loader.Export(exports['kdpdfl'][0])
    assert not exported.map_reduce_forms and not exported.distribute_aggregate_forms
    reason = exported.manifest['forms']['map_reduce_form']['reason']
    assert 'it is serverless' in reason
    # What there is: the whole round, with client states as federated values.
    assert '@CLIENTS' in str(exported.next.type_signature.result)
    with pytest.raises(loader.ExportError, match='kdpdfl has no map_reduce_form: it is serverless'):
        exported.run_round_map_reduce(exported.initialize(), [])


def _run(*args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def test_loader_binary_runs_rounds(exports, tmp_path):
    result = _run(
        '-m', 'deploy.loader', f'--export_dir={exports["fedavg"][0]}', f'--state_dir={tmp_path}/s', '--rounds=2'
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [['round', '1/2'], ['round', '2/2']]
    assert sorted(os.listdir(tmp_path / 's')) == [f'client_{i:05d}.state' for i in range(4)]


@pytest.mark.parametrize(
    'args, message',
    [
        (['--algorithm=fedavg'], 'tff-pfl-export: error: --output_dir is required'),
        (['--algorithm=nope', '--output_dir={out}'], "tff-pfl-export: error: unknown algorithm 'nope'"),
    ],
)
def test_export_binary_bad_input(args, message, tmp_path):
    out = tmp_path / 'out'
    result = _run('-m', 'tff_pfl.cli.export', *[a.format(out=out) for a in args])
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize('algorithm', algorithms.names())
def test_every_algorithm_exports_what_fits(algorithm, tiny_npz, tmp_path):
    own_architectures = algorithms.get(algorithm).own_architectures
    extra = dict(public_examples=40, architectures=('logistic', 'mnist_dnn')) if own_architectures else {}
    if not own_architectures:
        extra['model'] = 'mnist_dnn_bn' if algorithm == 'fedbn' else 'mnist_dnn'  # FedBN needs batch norm
    if algorithm == 'fedavg_ft':
        extra['finetune_epochs'] = 1
    config = run_config.make_config(
        output_dir=str(tmp_path / 'out'),
        algorithm=algorithm,
        dataset=f'npz:{tiny_npz}',
        partition='iid',
        num_clients=3,
        **{k: v for k, v in _small(algorithm).items() if k != 'finetune_epochs'},
        **extra,
    )
    manifest = export.export(config, log=lambda line: None)
    limit = algorithms.get(algorithm).not_one_aggregation
    for form in ('map_reduce_form', 'distribute_aggregate_form'):
        assert manifest['forms'][form]['exported'] == (limit is None)
        if limit is not None:
            assert manifest['forms'][form]['reason'] == limit
    exported = loader.Export(str(tmp_path / 'out'))  # every file reads back, hashes and types match
    round_names = exported.phases or ['next']
    assert set(exported.computations) >= {'initialize', 'initial_client_state', 'evaluate', *round_names}
    if limit is None:
        # The round that goes to production returns nothing placed at CLIENTS.
        assert exported.phases
        for phase in exported.phases:
            assert '@CLIENTS' not in str(exported.computations[phase].type_signature.result)
        assert any(name.startswith('client_work') for name in exported.computations)


def test_a_model_that_does_not_fit_the_data_is_a_config_error(tmp_path):
    config = run_config.make_config(
        output_dir=str(tmp_path / 'out'),
        algorithm='fedper',
        dataset='synthetic',
        model='logistic',
        num_clients=3,
        personal_layers=1,
    )
    with pytest.raises(run_config.ConfigError, match='personal_layers=1 leaves no shared layer'):
        export.export(config, log=lambda line: None)
    assert not (tmp_path / 'out').exists()


def _devices_dir(root, clients):
    """Per-client files in the clients:DIR layout (docs/data.md)."""
    root.mkdir()
    for name, arrays in clients.items():
        np.savez(root / f'{name}.npz', **arrays)
    (root / 'manifest.json').write_text(json.dumps({'format': 'npz', 'num_classes': 3}))
    return root


def test_devices_prepare_their_client_data_from_the_clients_dir_layout(tmp_path):
    """An export of a clients: source runs where only the per-client files are: the loader rebuilds what it reads."""
    rng = np.random.default_rng(3)
    clients = {
        name: dict(
            x_train=rng.random((n, 6)).astype(np.float32),
            y_train=rng.integers(0, 3, n),
            x_test=rng.random((4, 6)).astype(np.float32),
            y_test=rng.integers(0, 3, 4),
        )
        for name, n in (('ann', 9), ('ben', 6), ('cai', 12), ('dee', 7))
    }
    devices = _devices_dir(tmp_path / 'devices', clients)
    config = run_config.make_config(
        output_dir=str(tmp_path / 'export'),
        algorithm='fedavg',
        dataset=f'clients:{devices}',
        num_clients=3,
        model='logistic',
        batch_size=4,
        seed=5,
    )
    manifest = export.export(config, log=lambda line: None)
    root = manifest['client_data_root']
    assert manifest['client_data']['source_ids'] == ['ann', 'cai', 'dee']  # the seeded subset of 3
    original = {p: open(os.path.join(dirpath, p), 'rb').read() for dirpath, _, files in os.walk(root) for p in files}
    # Same machine: the files are there and equal what the devices give.
    exported = loader.Export(str(tmp_path / 'export'))
    assert exported.stage_clients_dir(str(devices), log=lambda line: None) == root
    # A worker that holds only the exported clients' files, elsewhere, and not the export's client data.
    only_mine = _devices_dir(tmp_path / 'elsewhere', {k: clients[k] for k in ('ann', 'cai', 'dee')})
    os.rename(root, str(tmp_path / 'moved'))
    result = _run(
        '-m',
        'deploy.loader',
        f'--export_dir={tmp_path / "export"}',
        f'--state_dir={tmp_path}/s',
        f'--clients_dir={only_mine}',
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith('round 1/1')
    rebuilt = {p: open(os.path.join(dirpath, p), 'rb').read() for dirpath, _, files in os.walk(root) for p in files}
    assert rebuilt == original
    # A device whose data differ from the export's, a missing device, an export of another source: one line each.
    clients['cai']['y_train'] = (clients['cai']['y_train'] + 1) % 3
    changed = _devices_dir(tmp_path / 'changed', clients)
    with pytest.raises(loader.ExportError, match="client 'cai' of .* differs from the data the export was made with"):
        exported.stage_clients_dir(str(changed), log=lambda line: None)
    partial = _devices_dir(tmp_path / 'partial', {'ann': clients['ann']})
    result = _run(
        '-m',
        'deploy.loader',
        f'--export_dir={tmp_path / "export"}',
        f'--state_dir={tmp_path}/t',
        f'--clients_dir={partial}',
    )
    assert result.returncode == 2 and result.stderr.strip().count('\n') == 0, result.stderr
    assert "has no client 'cai' (2 missing)" in result.stderr
    assert not (tmp_path / 't').exists()
    assert not [p for p in os.listdir(tmp_path / 'export') if p.startswith('.')]  # no scratch left behind


def test_clients_dir_staging_refuses_an_export_of_another_source(exports):
    with pytest.raises(loader.ExportError, match="made from 'synthetic', not from a clients:DIR source"):
        loader.Export(exports['fedavg'][0]).stage_clients_dir('/nonexistent', log=lambda line: None)


def test_manifest_says_how_the_uploads_are_aggregated(exports):
    manifests = {}
    for name in ('fedavg', 'fedavg_secure'):
        with open(os.path.join(exports[name][0], 'manifest.json')) as f:
            manifests[name] = json.load(f)['aggregation']
    plain, secure = manifests['fedavg'], manifests['fedavg_secure']
    assert (plain['dp'], plain['secure_aggregation'], secure['secure_aggregation']) == (False, False, True)
    assert 'federated_secure_sum_bitwidth' not in plain['phases']['next']
    # The model's update goes through the secure sum; only the training metrics' sums stay plain.
    assert secure['phases']['next'] == ['federated_secure_sum_bitwidth', 'federated_sum']
