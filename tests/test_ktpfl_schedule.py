"""KT-pFL's distillation schedule (`kt_distill_schedule`): 'every_epoch', Algorithm 1 / 2 read literally.

Two rounds of each variant against numpy re-implementations: in its first round a client only trains;
the server updates c and mixes the uploads with the new c; in its next round the client takes the R
distillation passes (transfer steps) after each of its E epochs, towards the target it kept.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import ktpfl, ktpfl_homo
from tests import numpy_reference as ref
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl.computations import audit, device_state
from tff_pfl.data import client_data

SEED = 5
SIZES = (37, 50, 23)
PUBLIC = 20
TEMPERATURE = 2.0
LOCAL = dict(local_epochs=2, batch_size=8, client_learning_rate=0.3)


@pytest.fixture(scope='module')
def spec(tmp_path_factory):
    return make_linear_problem(tmp_path_factory.mktemp('schedule') / 'data', sizes=SIZES, public_examples=PUBLIC)


def _hetero_settings(**overrides):
    values = dict(
        architectures=('logistic',),
        public_examples=PUBLIC,
        public_temperature=TEMPERATURE,
        public_distill_batch_size=8,
        public_distill_learning_rate=0.5,
        kt_distill_epochs=2,
        kt_coefficient_learning_rate=0.5,
        kt_rho=0.6,
        kt_distill_schedule='every_epoch',
        **LOCAL,
    )
    values.update(overrides)
    return ktpfl.KTpFLSettings(**values)


def _homo_settings(**overrides):
    values = dict(
        kt_transfer_steps=2,
        kt_transfer_learning_rate=0.3,
        kt_coefficient_learning_rate=0.05,
        kt_rho=0.6,
        kt_distill_schedule='every_epoch',
        **LOCAL,
    )
    values.update(overrides)
    return ktpfl_homo.KTpFLHomoSettings(**values)


def _model_fn(spec):
    return lambda: models.get('logistic')(spec.feature_shape, spec.num_classes)


# The numpy side: a logistic model [W, b] packed as the client state holds it.


def _unpack(w, dim, classes):
    return [w[: dim * classes].reshape(dim, classes).astype(np.float64), w[dim * classes :].astype(np.float64)]


def _pack(params):
    return np.concatenate([p.ravel() for p in params])


def _row_normalised(c):
    return c / c.sum(axis=1, keepdims=True)


def _clipped_step(objective, c, learning_rate):
    return np.maximum(c - learning_rate * ref.numeric_gradient(objective, c), 0.0)


def _train_every_epoch(params, x, y, client_id, round_num, after_epoch):
    """E epochs of SGD in the project's batch order, `after_epoch(params, epoch)` after each."""
    epochs, batch_size, learning_rate = LOCAL['local_epochs'], LOCAL['batch_size'], LOCAL['client_learning_rate']
    per_epoch, batch = ref.batch_stream(SEED, client_id, round_num, len(y), epochs, batch_size)
    for epoch in range(epochs):
        for i in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            idx = batch(i)
            _, grads = ref.loss_and_grads(params, x[idx], y[idx])
            params = [p - learning_rate * g for p, g in zip(params, grads)]
        params = after_epoch(params, epoch)
    return params


def _transfer(params, epoch, *, target):
    """R = 2 steps of Eq. 10 (eta_2 = 0.3) towards the kept u_n, after every epoch; none without a target."""
    del epoch
    if target is None:
        return params
    for _ in range(2):
        params = [p - 0.3 * (p - t) for p, t in zip(params, target)]
    return params


def test_homogeneous_every_epoch_two_rounds_against_numpy(spec, tff_runtime):
    proc = ktpfl_homo.build_ktpfl_homogeneous_process(spec, _model_fn(spec), _homo_settings(), seed=SEED)
    state = proc.initialize()
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    dim, classes, n = 4, spec.num_classes, len(SIZES)
    w = [_unpack(np.asarray(s['params']), dim, classes) for s in states]
    data = [ref.read(spec, c) for c in spec.client_ids]
    c = np.full((n, n), 1 / n)
    targets = [None] * n  # no client has a target before its first round
    sizes = np.array(SIZES, np.float64)

    def objective(m, uploads):
        mixed = _row_normalised(m) @ uploads
        distance = 0.5 * ((mixed - uploads) ** 2).sum(axis=1)
        return (sizes / sizes.sum() * distance).sum() + 0.6 * ((m - 1 / n) ** 2).sum()

    for round_num in range(2):
        distances = []
        for k, client_id in enumerate(spec.client_ids):
            target = None if targets[k] is None else _unpack(targets[k], dim, classes)
            w[k] = _train_every_epoch(w[k], *data[k], client_id, round_num, functools.partial(_transfer, target=target))
            distances.append(0.0 if target is None else 0.5 * ((_pack(w[k]) - targets[k]) ** 2).sum())
        uploads = np.stack([_pack(p) for p in w])
        c = _clipped_step(functools.partial(objective, uploads=uploads), c, 0.05)
        targets = list(_row_normalised(c) @ uploads)  # mixed with the c just updated, kept for the next round

        state, states, metrics = proc.next(state, states)
        np.testing.assert_allclose(state['coefficients'], c, atol=1e-5)
        for k, s in enumerate(states):
            np.testing.assert_allclose(s['params'], uploads[k], atol=2e-5)
            np.testing.assert_allclose(s['target'], targets[k], atol=2e-5)
        assert metrics['transfer_distance'] == pytest.approx(np.mean(distances), rel=1e-3, abs=1e-9)
    assert not np.allclose(c, 1 / n) and metrics['transfer_distance'] > 0


def _soft(params, x):
    return ref.softmax(ref.forward(params, x)[0] / TEMPERATURE)


def _distil(params, epoch, *, target, x, client_id, round_num, kls):
    """R = 2 passes of Eq. 6 (T^2 KL, batches of 8, eta_2 = 0.5) on the target's public batch x."""
    if target is None:
        return params
    per_epoch, batch = ref.batch_stream(SEED, client_id, round_num, PUBLIC, 2, 8, salt=2, offset=[epoch, 0])
    kl_sum = 0.0
    for i in range(2 * per_epoch):
        rows = batch(i)
        p, q = target[rows], _soft(params, x[rows])
        kl_sum += (p * (np.log(np.maximum(p, 1e-8)) - np.log(q))).sum()
        dz = TEMPERATURE * (q - p) / len(rows)  # d(T^2 mean KL) / d logits
        params = [params[0] - 0.5 * x[rows].T @ dz, params[1] - 0.5 * dz.sum(axis=0)]
    kls.append(kl_sum / (2 * PUBLIC))  # the mean KL of the epoch's passes, before each step
    return params


def test_every_epoch_two_rounds_against_numpy(spec, tff_runtime):
    proc = ktpfl.build_ktpfl_process(spec, _hetero_settings(), seed=SEED)
    state = proc.initialize()
    states = [proc.initial_client_state(c) for c in spec.client_ids]
    dim, classes, n = 4, spec.num_classes, len(SIZES)
    w = [_unpack(np.asarray(s['params'])[: dim * classes + classes], dim, classes) for s in states]
    data = [ref.read(spec, c) for c in spec.client_ids]
    c = np.full((n, n), 1 / n)
    targets, x_target = [None] * n, None
    sizes = np.array(SIZES, np.float64)

    def objective(m, s):
        t = np.einsum('nm,mpc->npc', _row_normalised(m), s)
        kl = (t * (np.log(np.maximum(t, 1e-8)) - np.log(np.maximum(s, 1e-8)))).sum(-1).mean(-1)
        # Eq. 4's KL term carries T^2, as Eq. 6's step does (docs/algorithms/ktpfl.md).
        return TEMPERATURE**2 * (sizes / sizes.sum() * kl).sum() + 0.6 * ((m - 1 / n) ** 2).sum()

    for round_num in range(2):
        x_public = client_data.read_public_batch(spec, PUBLIC, SEED, tf.constant(round_num)).numpy()
        x_public = x_public.reshape(PUBLIC, -1).astype(np.float64)
        mean_kls = []
        for k, client_id in enumerate(spec.client_ids):
            kls = []
            distil = functools.partial(
                _distil, target=targets[k], x=x_target, client_id=client_id, round_num=round_num, kls=kls
            )
            w[k] = _train_every_epoch(w[k], *data[k], client_id, round_num, distil)
            mean_kls.append(np.mean(kls) if kls else 0.0)
        s = np.stack([_soft(p, x_public) for p in w])  # predicted after the round's last distillation
        c = _clipped_step(functools.partial(objective, s=s), c, 0.5)
        targets, x_target = list(np.einsum('nm,mpc->npc', _row_normalised(c), s)), x_public

        state, states, metrics = proc.next(state, states)
        np.testing.assert_allclose(state['coefficients'], c, atol=2e-5)
        for k, st in enumerate(states):
            np.testing.assert_allclose(np.asarray(st['params'])[: dim * classes + classes], _pack(w[k]), atol=2e-5)
            np.testing.assert_allclose(st['target'], targets[k], atol=2e-5)
            assert float(st['last_distill_kl']) == pytest.approx(mean_kls[k], rel=1e-3, abs=1e-9)
        assert metrics['distill_kl'] == pytest.approx(np.mean(mean_kls), rel=1e-3, abs=1e-9)
    assert not np.allclose(c, 1 / n) and metrics['distill_kl'] > 0


def _crossings(comps):
    return sorted((uri, str(t)) for comp in comps for uri, t in audit.clients_to_server_values(comp))


@pytest.mark.parametrize('variant', ['ktpfl', 'ktpfl_homo'])
def test_every_epoch_sends_the_server_what_after_training_does(spec, variant):
    def build(schedule):
        if variant == 'ktpfl':
            return ktpfl.build_ktpfl_process(spec, _hetero_settings(kt_distill_schedule=schedule))
        return ktpfl_homo.build_ktpfl_homogeneous_process(
            spec, _model_fn(spec), _homo_settings(kt_distill_schedule=schedule)
        )

    after, every = build('after_training'), build('every_epoch')
    assert _crossings([every.next]) == _crossings([after.next])
    assert _crossings(every.device.phases.values()) == _crossings(after.device.phases.values())
    assert list(after.device.phases) == ['share', 'distill'] and list(every.device.phases) == ['share', 'targets']
    assert every.extras['communication'] == after.extras['communication']
    # Only the client state grows: the target it keeps between its rounds.
    target = f'float32[{PUBLIC},3]' if variant == 'ktpfl' else 'float32[15]'
    assert f'target={target}' in str(every.next.type_signature.parameter[1])
    assert 'target=' not in str(after.next.type_signature.parameter[1])


def test_every_epoch_device_form_is_the_in_process_round(spec, tmp_path, tff_runtime):
    proc = ktpfl.build_ktpfl_process(spec, _hetero_settings(), seed=SEED)
    device = proc.device
    ids = list(spec.client_ids)
    states = {c: proc.initial_client_state(c) for c in ids}
    devices = {c: device_state.device_input(c, str(tmp_path)) for c in ids}
    state, device_server = proc.initialize(), device.initialize()
    for sampled in (ids, ids[1:], ids):  # the first client skips a round: it keeps its target
        before = device_state.load(devices[ids[0]]['state_file'], states[ids[0]]) if sampled != ids else None
        output = proc.next(state, [states[c] for c in sampled])
        states.update(zip(sampled, output.client_states))
        device_server, metrics = device_state.run_round(device, device_server, [devices[c] for c in sampled])
        np.testing.assert_array_equal(output.state['coefficients'], device_server['coefficients'])
        assert dict(output.metrics) == pytest.approx(dict(metrics), rel=0, abs=0)
        for c in ids:
            kept = device_state.load(devices[c]['state_file'], states[c])
            for a, b in zip(tff.structure.flatten(states[c]), tff.structure.flatten(kept)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if before is not None:
            np.testing.assert_array_equal(states[ids[0]]['target'], before['target'])
        state = output.state
    # Both phases convert to TFF's production form.
    for phase in device.phases.values():
        tff.backends.mapreduce.get_map_reduce_form_for_computation(phase)
