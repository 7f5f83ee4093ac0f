"""Clients with different architectures behind one TFF type (TF code).

TFF gives every client the same type, while KT-pFL's clients run different
models. A client's state therefore holds its architecture id and its weights
packed into one float vector, zero-padded to the largest architecture's size;
inside the client computation `dispatch` builds every registered architecture,
unpacks the vector into the client's own one and runs the work there through
`tf.switch_case`. Only fixed-shape values (soft predictions) need to leave
the client, so the round's type says exactly what is exchanged.
"""

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf


class Architectures:
    """A fixed list of model builders, addressed by index.

    Attributes:
      model_fns: no-arg builders.
      sizes: number of parameters of each.
      max_size: the packed vector's length.
    """

    def __init__(self, model_fns: Sequence[Callable[[], tf.keras.Model]]):
        self.model_fns = list(model_fns)
        self.shapes = []
        with tf.Graph().as_default():
            for fn in self.model_fns:
                model = fn()
                if model.non_trainable_weights:
                    raise ValueError(f'model {model.name!r} has non-trainable weights')
                self.shapes.append([tuple(v.shape) for v in model.trainable_weights])
        self.sizes = [int(sum(np.prod(s) for s in shapes)) for shapes in self.shapes]
        self.max_size = max(self.sizes)

    def pack(self, weights) -> tf.Tensor:
        """Weights -> float32 [max_size] (zero-padded).

        Args:
          weights: one architecture's trainable weights, in Keras order.

        Returns:
          The weights flattened, concatenated and zero-padded to `max_size`.
        """
        flat = tf.concat([tf.reshape(w, [-1]) for w in weights], axis=0)
        return tf.pad(flat, [[0, self.max_size - tf.shape(flat)[0]]])

    def unpack(self, index: int, packed: tf.Tensor) -> list:
        """float32 [max_size] -> the weights of architecture `index`.

        Args:
          index: the architecture's index (a Python int).
          packed: a vector made by `pack` for that architecture.

        Returns:
          The list of the architecture's weight tensors, in Keras order.
        """
        weights, offset = [], 0
        for shape in self.shapes[index]:
            size = int(np.prod(shape))
            weights.append(tf.reshape(packed[offset : offset + size], shape))
            offset += size
        return weights

    def dispatch(self, arch_id: tf.Tensor, packed: tf.Tensor, work: Callable):
        """Runs `work(model)` on the client's own architecture.

        Every architecture's model is built (variables cannot be created inside
        a branch); the branch of `arch_id` loads `packed` into its model and
        returns `work(model)`, whose structure must not depend on the
        architecture.

        Args:
          arch_id: int32 scalar, the client's architecture index.
          packed: float32 [max_size], the client's packed weights.
          work: `model -> nest of tensors` (TF code), run on the loaded model.

        Returns:
          What `work` returns.
        """
        built = [fn() for fn in self.model_fns]

        def branch(index):
            def run():
                model = built[index]
                with tf.control_dependencies(
                    [v.assign(w) for v, w in zip(model.trainable_weights, self.unpack(index, packed))]
                ):
                    return work(model)

            return run

        return tf.switch_case(arch_id, [branch(i) for i in range(len(built))])

    def initial_packed(self, seed: int) -> tf.Tensor:
        """[num_architectures, max_size]: each architecture's seeded initial weights.

        Args:
          seed: the run seed; architecture `i` is built under `seed + i`.

        Returns:
          A float32 tensor whose row `i` is `pack` of architecture `i`'s
          initial weights.
        """
        from tff_pfl import models

        rows = []
        for index, fn in enumerate(self.model_fns):
            with models.seeded(seed + index):
                rows.append(self.pack(fn().trainable_weights))
        return tf.stack(rows)


def for_clients(architectures: Sequence[str], spec) -> tuple['Architectures', list[int]]:
    """The distinct architectures of a partition's clients, and each client's index into them.

    Args:
      architectures: one model name (`tff_pfl.models`) per client, in
        `spec.client_ids` order.
      spec: the `client_data.ClientDataSpec` (feature shape, classes, clients).

    Returns:
      `(Architectures over the sorted distinct names, per-client indices)`.

    Raises:
      ValueError: if there is not exactly one architecture per client.
    """
    from tff_pfl import models

    if len(architectures) != spec.num_clients:
        raise ValueError(f'need one architecture per client ({spec.num_clients}), got {len(architectures)}')
    names = sorted(set(architectures))
    archs = Architectures([lambda n=n: models.get(n)(spec.feature_shape, spec.num_classes) for n in names])
    return archs, [names.index(a) for a in architectures]
