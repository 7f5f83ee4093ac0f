"""Local work on one client's whole-tensor data: SGD training and evaluation.

These are TensorFlow functions meant to run inside a client's
`tff.tensorflow.computation`. Data arrive as a whole-tensor
`client_data.ClientSplit` (see `tff_pfl.data.client_data.read_split`); batches are cut by slicing a seeded
permutation inside a `tf.while_loop`, never through `tf.data`.

Every algorithm reuses `train`: what differs between algorithms is the loss,
which is any `LossFn(model, x_batch, y_batch) -> (mean_loss, logits)`; a
distillation loss closes over a teacher model, a proximal loss over the global
weights.
"""

import collections
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl.data import client_data

LossFn = Callable[[tf.keras.Model, tf.Tensor, tf.Tensor], tuple[tf.Tensor, tf.Tensor]]

# Sums over the examples seen; divide by `num_examples` for means.
Stats = collections.namedtuple('Stats', ['loss_sum', 'num_correct', 'num_examples'])


def weights_type(model_fn: Callable[[], tf.keras.Model]) -> tff.Type:
    """The TFF type of a model's trainable weights: a list of float tensors.

    Args:
      model_fn: no-arg function returning a fresh Keras model.

    Returns:
      A `tff.StructWithPythonType` (list container) of `tff.TensorType`s.

    Raises:
      ValueError: if the model has non-trainable weights (batch-norm
        statistics and the like are not averaged by these algorithms).
    """
    with tf.Graph().as_default():
        model = model_fn()
        if model.non_trainable_weights:
            raise ValueError(
                f'model {model.name!r} has non-trainable weights, which are not supported'
            )
        return tff.StructWithPythonType(
            [tff.TensorType(v.dtype.as_numpy_dtype, v.shape) for v in model.trainable_weights],
            list,
        )


def get_weights(model: tf.keras.Model) -> list[tf.Tensor]:
    """Current trainable weights as tensors (a snapshot, not variables)."""
    return [tf.identity(v) for v in model.trainable_weights]


def assign_weights(model: tf.keras.Model, weights: Sequence[tf.Tensor]) -> list:
    """Assigns `weights` to the model's trainable variables; returns the ops."""
    return [v.assign(w) for v, w in zip(model.trainable_weights, weights)]


def supervised_loss(model: tf.keras.Model, x: tf.Tensor, y: tf.Tensor):
    """Mean sparse softmax cross-entropy of the model's logits; the default loss."""
    logits = model(x, training=True)
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    )
    return loss, logits


def _correct(logits: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), y), tf.float32))


def epoch_permutations(seed: tf.Tensor, epochs, num_examples) -> tf.Tensor:
    """One permutation of range(num_examples) per epoch, from a stateless seed.

    Returns:
      int32 tensor [max(epochs, 1), num_examples]: the example order of each
      epoch (argsort of stateless uniform noise).
    """
    noise = tf.random.stateless_uniform(
        tf.stack([tf.maximum(tf.cast(epochs, tf.int32), 1), tf.cast(num_examples, tf.int32)]),
        seed=seed,
    )
    return tf.argsort(noise, axis=1)


def train(
    model: tf.keras.Model,
    data: client_data.ClientSplit,
    *,
    epochs,
    batch_size,
    learning_rate,
    seed: tf.Tensor,
    loss_fn: LossFn = supervised_loss,
    max_steps=None,
) -> Stats:
    """Mini-batch SGD on whole tensors, in place on `model`'s variables.

    Each epoch visits the examples in a fresh permutation drawn from
    `seed`; the last batch of an epoch may be smaller than `batch_size`.

    Args:
      model: the Keras model to train (its variables are updated).
      data: the client's whole training split.
      epochs: number of passes over the data (int or scalar tensor).
      batch_size: examples per step.
      learning_rate: SGD step size.
      seed: int64 tensor of shape [2], for the stateless permutations.
      loss_fn: `(model, x_batch, y_batch) -> (mean loss, logits)`.
      max_steps: optional cap on the number of SGD steps (None: no cap).

    Returns:
      `Stats` summed over every example seen during training (with the
      weights as they were before each step).
    """
    epochs = tf.cast(epochs, tf.int32)
    batch_size = tf.cast(batch_size, tf.int32)
    learning_rate = tf.cast(learning_rate, tf.float32)

    @tf.function(autograph=False)
    def loop(features, labels, seed):
        split = data.with_tensors(features, labels)
        num_examples = split.num_examples
        batches_per_epoch = (num_examples + batch_size - 1) // batch_size
        total_steps = epochs * batches_per_epoch
        if max_steps is not None:
            total_steps = tf.minimum(total_steps, tf.cast(max_steps, tf.int32))
        permutations = epoch_permutations(seed, epochs, num_examples)
        variables = model.trainable_variables

        def body(step, loss_sum, num_correct, num_seen):
            epoch = step // batches_per_epoch
            start = (step % batches_per_epoch) * batch_size
            stop = tf.minimum(start + batch_size, num_examples)
            x_batch, y_batch = split.gather(permutations[epoch, start:stop])
            with tf.GradientTape() as tape:
                loss, logits = loss_fn(model, x_batch, y_batch)
            grads = tape.gradient(loss, variables)
            for variable, grad in zip(variables, grads):
                variable.assign_sub(learning_rate * grad)
            batch_len = tf.cast(stop - start, tf.float32)
            return (
                step + 1,
                loss_sum + loss * batch_len,
                num_correct + _correct(logits, y_batch),
                num_seen + batch_len,
            )

        zero = tf.constant(0.0)
        _, loss_sum, num_correct, num_seen = tf.while_loop(
            lambda step, *_: step < total_steps,
            body,
            (tf.constant(0), zero, zero, zero),
        )
        return Stats(loss_sum, num_correct, num_seen)

    return loop(data.features, data.labels, seed)


def evaluate(model: tf.keras.Model, data: client_data.ClientSplit, batch_size: int = 1000) -> Stats:
    """Cross-entropy and accuracy sums of `model` on a whole split, in batches.

    Args:
      model: the Keras model to evaluate (inference mode).
      data: the split.
      batch_size: examples per forward pass (memory bound only).

    Returns:
      `Stats` summed over all examples.
    """

    @tf.function(autograph=False)
    def loop(features, labels):
        split = data.with_tensors(features, labels)
        num_examples = split.num_examples

        def body(start, loss_sum, num_correct):
            stop = tf.minimum(start + batch_size, num_examples)
            x, y = split.slice(start, stop)
            logits = model(x, training=False)
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            return stop, loss_sum + tf.reduce_sum(losses), num_correct + _correct(logits, y)

        zero = tf.constant(0.0)
        _, loss_sum, num_correct = tf.while_loop(
            lambda start, *_: start < num_examples, body, (tf.constant(0), zero, zero)
        )
        return Stats(loss_sum, num_correct, tf.cast(num_examples, tf.float32))

    return loop(data.features, data.labels)


def client_seed(base_seed: int, round_num: tf.Tensor, client_id: tf.Tensor, salt: int = 0) -> tf.Tensor:
    """A stateless seed (int64 [2]) unique to (run seed, round, client, salt).

    Deterministic for a given run seed, independent of which other clients
    were sampled or in which order the runtime schedules them.
    """
    client_hash = tf.strings.to_hash_bucket_fast(client_id, np.iinfo(np.int32).max)
    round_part = tf.cast(round_num, tf.int64) * 1009 + salt
    return tf.stack([tf.constant(base_seed, tf.int64) * 1_000_003 + round_part, client_hash])


class TrainingConfig(
    collections.namedtuple('TrainingConfig', ['epochs', 'batch_size', 'learning_rate', 'max_steps'], defaults=[None])
):
    """Local SGD settings: passes over the data, batch size, step size, and an
    optional cap on the number of steps (e.g. "20 local steps")."""

    def validate(self) -> 'TrainingConfig':
        """Returns self, or raises ValueError naming the bad field."""
        if int(self.epochs) != self.epochs or self.epochs < 1:
            raise ValueError(f'local epochs must be a positive integer, got {self.epochs}')
        if int(self.batch_size) != self.batch_size or self.batch_size < 1:
            raise ValueError(f'batch size must be a positive integer, got {self.batch_size}')
        if not self.learning_rate > 0:
            raise ValueError(f'learning rate must be positive, got {self.learning_rate}')
        if self.max_steps is not None and (int(self.max_steps) != self.max_steps or self.max_steps < 1):
            raise ValueError(f'local steps must be a positive integer, got {self.max_steps}')
        return self
