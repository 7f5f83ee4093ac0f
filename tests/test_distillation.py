"""PersFL's distillation: the loss by hand, one step against numpy, grid == sequential."""

import numpy as np
import pytest
import tensorflow as tf

from tff_pfl import losses, models
from tff_pfl.computations import distillation, local_training
from tff_pfl.data import client_data
from tff_pfl.models import stacked


def _softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


STUDENT = np.array([[2.0, -1.0, 0.5], [0.1, 0.2, -0.3]])
TEACHER = np.array([[1.0, 0.0, -1.0], [-2.0, 3.0, 0.0]])
LABELS = np.array([0, 2])


@pytest.mark.parametrize('soft', ['kl', 'ce', 'kl_elements', 'ce_elements'])
@pytest.mark.parametrize('temperature, imitation', [(1.0, 0.0), (4.0, 0.25), (9.0, 1.0)])
def test_loss_by_hand(soft, temperature, imitation):
    p = _softmax(STUDENT)
    hard = -np.mean(np.log(p[np.arange(2), LABELS]))
    pt, ps = _softmax(TEACHER / temperature), _softmax(STUDENT / temperature)
    if soft.startswith('kl'):
        per_logit = pt * np.log(pt / ps)
    else:
        per_logit = -pt * np.log(ps)
    # 'examples': the sum over classes, averaged over the batch; '_elements': the mean over every logit.
    soft_term = np.mean(per_logit) if soft.endswith('_elements') else np.mean(np.sum(per_logit, axis=1))
    expected = (1 - imitation) * hard + imitation * temperature**2 * soft_term
    got = losses.persfl_loss(
        tf.constant(STUDENT, tf.float32),
        tf.constant(TEACHER, tf.float32),
        tf.constant(LABELS),
        temperature,
        imitation,
        soft,
    )
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)


def test_kl_and_ce_differ_by_teacher_entropy_and_share_gradients():
    student = tf.Variable(STUDENT, dtype=tf.float32)
    teacher = tf.constant(TEACHER, tf.float32)
    grads, values = {}, {}
    for soft in ('kl', 'ce'):
        with tf.GradientTape() as tape:
            values[soft] = losses.persfl_loss(student, teacher, tf.constant(LABELS), 3.0, 0.5, soft)
        grads[soft] = tape.gradient(values[soft], student).numpy()
    pt = _softmax(TEACHER / 3.0)
    entropy = np.mean(-np.sum(pt * np.log(pt), axis=1))
    np.testing.assert_allclose(values['ce'] - values['kl'], 0.5 * 9.0 * entropy, rtol=1e-5)
    np.testing.assert_allclose(grads['kl'], grads['ce'], atol=1e-6)


def test_an_unknown_soft_loss_is_refused():
    with pytest.raises(ValueError, match='soft loss must be one of'):
        losses.persfl_loss(tf.constant(STUDENT), tf.constant(TEACHER), tf.constant(LABELS), 1.0, 0.5, 'kl_mean')


def test_stacked_losses_broadcast_per_candidate():
    students = tf.constant(np.stack([STUDENT, STUDENT * 2]), tf.float32)
    got = losses.persfl_loss(students, tf.constant(TEACHER, tf.float32), tf.constant(LABELS), [1.0, 5.0], [0.0, 0.5])
    for g, (t, lam) in enumerate([(1.0, 0.0), (5.0, 0.5)]):
        one = losses.persfl_loss(students[g], tf.constant(TEACHER, tf.float32), tf.constant(LABELS), t, lam)
        np.testing.assert_allclose(got[g].numpy(), one.numpy(), rtol=1e-6)


def test_grid_candidates():
    candidates = distillation.grid_candidates([5, 1, 5], [0.5, 0, 1])
    assert candidates == [(1.0, 0.0), (1.0, 0.5), (5.0, 0.5), (1.0, 1.0)]
    # The paper's grid: 7 x 5 = 35 pairs, of which 1 + 7 * 3 + 1 = 23 differ.
    assert len(distillation.grid_candidates([1, 5, 9, 13, 17, 21, 25], [0, 0.25, 0.5, 0.75, 1])) == 23
    for bad in (([], [0.5]), ([0.0], [0.5]), ([1.0], [1.5])):
        with pytest.raises(ValueError):
            distillation.grid_candidates(*bad)


def _split(x, y):
    return client_data.ClientSplit(tf.constant(x, tf.float32), tf.constant(y, tf.int32))


def _problem(seed=0, n=40, dim=6, classes=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2 * n, dim)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(dim, classes)), axis=1).astype(np.int32)
    return _split(x[:n], y[:n]), _split(x[n:], y[n:]), x[:n], y[:n]


@pytest.mark.parametrize('soft', ['kl', 'kl_elements'])
def test_full_batch_steps_match_numpy_gradients(soft):
    train, val, x, y = _problem()
    model = models.logistic_regression((6,), 3)
    rng = np.random.default_rng(1)
    wt, bt = rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    candidates = [(1.0, 0.0), (3.0, 0.5), (7.0, 1.0)]
    temperatures, imitations = distillation.candidate_arrays(candidates)
    # Three full-batch steps: students start at the teacher (PersFL initialises
    # A_k with O_k), so the soft term acts from the second step on.
    config = local_training.TrainingConfig(epochs=3, batch_size=1000, learning_rate=0.5)
    result = distillation.distill_grid(
        stacked.plan(model),
        [tf.constant(wt), tf.constant(bt)],
        train,
        val,
        temperatures=tf.constant(temperatures),
        imitations=tf.constant(imitations),
        config=config,
        seed=tf.constant([0, 0], tf.int64),
        soft=soft,
    )
    x64, onehot = x.astype(np.float64), np.eye(3)[y]
    # 'kl_elements' averages the soft term over the 3 classes too: its gradient is a third.
    scale = 1.0 / 3.0 if soft == 'kl_elements' else 1.0
    pt_logits = x64 @ wt + bt
    for g, (t, lam) in enumerate(candidates):
        w, b = wt.astype(np.float64), bt.astype(np.float64)
        for _ in range(3):
            z = x64 @ w + b
            soft_dz = scale * lam * t * (_softmax(z / t) - _softmax(pt_logits / t))
            dz = ((1 - lam) * (_softmax(z) - onehot) + soft_dz) / len(y)
            w, b = w - 0.5 * x64.T @ dz, b - 0.5 * dz.sum(0)
        np.testing.assert_allclose(result.weights[0][g].numpy(), w, atol=1e-5)
        np.testing.assert_allclose(result.weights[1][g].numpy(), b, atol=1e-5)
        if lam == 1.0:  # pure imitation from the teacher's start: the teacher is a fixed point
            np.testing.assert_allclose(w, wt, atol=1e-6)
    accuracy = [
        np.mean(
            np.argmax(val.features.numpy() @ result.weights[0][g].numpy() + result.weights[1][g].numpy(), 1)
            == val.labels.numpy()
        )
        for g in range(3)
    ]
    np.testing.assert_allclose(result.val_accuracy.numpy(), accuracy, rtol=1e-6)
    assert int(result.best) == int(np.argmax(accuracy))


@pytest.mark.parametrize('soft', ['kl', 'ce'])
def test_grid_equals_sequential(soft):
    train, val, _, _ = _problem(seed=3, n=50, dim=8, classes=4)
    model = models.mnist_dnn((8,), 4)
    teacher = [tf.constant(w) for w in model.get_weights()]
    temperatures, imitations = distillation.candidate_arrays(distillation.grid_candidates([1, 4, 9], [0, 0.5, 1]))
    kwargs = dict(
        temperatures=tf.constant(temperatures),
        imitations=tf.constant(imitations),
        config=local_training.TrainingConfig(epochs=3, batch_size=8, learning_rate=0.1),
        seed=tf.constant([5, 7], tf.int64),
        soft=soft,
    )
    layers = stacked.plan(model)
    grid = tf.function(lambda: distillation.distill_grid(layers, teacher, train, val, **kwargs))()
    sequential = tf.function(lambda: distillation.distill_sequential(layers, teacher, train, val, **kwargs))()
    assert int(grid.best) == int(sequential.best)
    np.testing.assert_allclose(grid.val_accuracy.numpy(), sequential.val_accuracy.numpy())
    for a, b in zip(grid.weights, sequential.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)
    # Training moved the students, differently per candidate.
    assert not np.allclose(grid.weights[0][0].numpy(), teacher[0].numpy())
    assert not np.allclose(grid.weights[0][1].numpy(), grid.weights[0][-1].numpy())


def test_halving_keeps_the_best_third_per_rung_and_ends_with_the_grid_of_its_survivors():
    # Full-batch steps (batch >= n): the rungs at 1/9, 1/3 and all of 9 steps are grids of 1, 3 and 9 epochs.
    train, val, _, _ = _problem(seed=4, n=60, dim=8, classes=4)
    model = models.mnist_dnn((8,), 4)
    teacher = [tf.constant(w) for w in model.get_weights()]
    temperatures, imitations = distillation.candidate_arrays(
        distillation.grid_candidates([1, 2, 4, 9], [0, 0.25, 0.5, 0.75, 1])
    )
    assert distillation.halving_survivors(len(temperatures)) == [14, 5, 2]
    layers = stacked.plan(model)

    def run(search, epochs):
        config = local_training.TrainingConfig(epochs=epochs, batch_size=1000, learning_rate=0.5)
        kwargs = dict(temperatures=tf.constant(temperatures), imitations=tf.constant(imitations), config=config)
        return tf.function(lambda: search(layers, teacher, train, val, seed=tf.constant([5, 7], tf.int64), **kwargs))()

    halving = run(distillation.distill_halving, 9)
    grids = {epochs: run(distillation.distill_grid, epochs) for epochs in (1, 3, 9)}
    # The reference: numpy's ranking of the grids' accuracies, the best third of each rung (earlier on ties).
    alive, expected_accuracy = np.arange(14), np.zeros(14)
    for epochs, keep in ((1, 5), (3, 2), (9, None)):
        accuracy = grids[epochs].val_accuracy.numpy()[alive]
        expected_accuracy[alive] = accuracy
        if keep is None:
            best = alive[np.argmax(accuracy)]
        else:
            alive = np.sort(alive[np.argsort(-accuracy, kind='stable')[:keep]])
            if epochs == 1:
                cut_first = np.setdiff1d(np.arange(14), alive)
    np.testing.assert_allclose(halving.val_accuracy.numpy(), expected_accuracy, atol=1e-6)
    assert int(halving.best) == best
    for got, want in zip(halving.weights, grids[9].weights):
        np.testing.assert_allclose(got.numpy()[alive], want.numpy()[alive], atol=1e-5)
    # The candidates were not all alike, and some were cut (their weights are those of an earlier rung).
    assert len(set(np.round(grids[1].val_accuracy.numpy(), 6))) > 1
    assert len(cut_first) == 9
    for got, want in zip(halving.weights, grids[1].weights):
        np.testing.assert_allclose(got.numpy()[cut_first], want.numpy()[cut_first], atol=1e-5)


def _batch_norm_mlp(dim=6, classes=3):
    inputs = tf.keras.Input([dim])
    hidden = tf.keras.layers.BatchNormalization(name='input_norm')(inputs)
    hidden = tf.keras.layers.Dense(8)(hidden)
    hidden = tf.keras.layers.BatchNormalization(center=False, name='hidden_norm')(hidden)
    hidden = tf.keras.layers.ReLU()(hidden)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(classes)(hidden))


@pytest.mark.parametrize('training', [False, True])
def test_stacked_batch_norm_is_kerass_under_training(training):
    rng = np.random.default_rng(4)
    models_ = [_batch_norm_mlp() for _ in range(3)]
    for model in models_:
        for weight in model.trainable_weights:
            weight.assign(rng.normal(size=weight.shape).astype(np.float32))
    x = rng.normal(2.0, 3.0, size=(9, 6)).astype(np.float32)
    weights = [tf.stack([m.trainable_weights[i] for m in models_]) for i in range(len(models_[0].trainable_weights))]
    got = stacked.forward(stacked.plan(models_[0]), weights, tf.constant(x), training=training).numpy()
    want = np.stack([m(x, training=training).numpy() for m in models_])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_grid_with_batch_norm_trains_each_student_as_keras_does():
    """Students train on their batches' statistics (Keras's `training=True`), the teacher and validation use
    a fresh model's moving statistics (`training=False`), as the project's local training and evaluation do."""
    train, val, x, y = _problem(seed=2, n=30)
    teacher_model = _batch_norm_mlp()
    teacher = [tf.constant(w) for w in teacher_model.trainable_weights]
    candidates = [(1.0, 0.0), (4.0, 0.5), (9.0, 1.0)]
    temperatures, imitations = distillation.candidate_arrays(candidates)
    config = local_training.TrainingConfig(epochs=2, batch_size=8, learning_rate=0.1)
    seed = tf.constant([3, 1], tf.int64)
    result = distillation.distill_grid(
        stacked.plan(teacher_model),
        teacher,
        train,
        val,
        temperatures=tf.constant(temperatures),
        imitations=tf.constant(imitations),
        config=config,
        seed=seed,
    )
    permutations = local_training.epoch_permutations(seed, 2, len(y)).numpy()
    teacher_logits = teacher_model(x, training=False).numpy()
    for g, (temperature, imitation) in enumerate(candidates):
        student = _batch_norm_mlp()
        student.set_weights(teacher_model.get_weights())
        for epoch in range(2):
            for start in range(0, len(y), 8):
                rows = permutations[epoch, start : start + 8]
                with tf.GradientTape() as tape:
                    logits = student(x[rows], training=True)
                    labels = tf.constant(y[rows])
                    loss = losses.persfl_loss(logits, teacher_logits[rows], labels, temperature, imitation)
                grads = tape.gradient(loss, student.trainable_weights)
                for weight, grad in zip(student.trainable_weights, grads):
                    weight.assign_sub(0.1 * grad)
        for got, want in zip(result.weights, student.trainable_weights):
            np.testing.assert_allclose(got[g].numpy(), want.numpy(), atol=1e-5)
        fresh = _batch_norm_mlp()
        for weight, trained in zip(fresh.trainable_weights, student.trainable_weights):
            weight.assign(trained)
        accuracy = np.mean(np.argmax(fresh(val.features, training=False).numpy(), 1) == val.labels.numpy())
        np.testing.assert_allclose(result.val_accuracy[g].numpy(), accuracy, rtol=1e-6)
    assert not np.allclose(result.weights[2][0].numpy(), teacher[2].numpy())  # it trained (the hidden kernel)
