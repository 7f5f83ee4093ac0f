"""pFedHN's hypernetwork h(v_i; phi): client embeddings, an MLP, and output heads that write a whole target model.

The parts of `processes/pfedhn.py` that are plain TensorFlow and numpy (no TFF):
the layout of phi, its initialisation, the generation of the clients' models
theta_i = h(v_i; phi) (`HyperNetwork.generate`) and the server's step
direction (grad_phi theta_i)^T (theta_i - theta_i_tilde), a vector-Jacobian
product (`HyperNetwork.gradient`).

Two output layouts (docs/algorithms/pfedhn.md, "Output layouts"):

* `dense` (the paper's main text): one linear head per weight tensor of the
  target model, from the MLP's last hidden layer; phi holds hidden x D head
  weights for a target of D parameters;
* `chunked` (the paper's supplement, for large targets): the target's packed
  parameters are cut into M = ceil(D / C) chunks of C; chunk j has a learned
  chunk embedding c_j, the MLP reads [v_i, c_j] and one shared head writes the
  C parameters of every chunk, around a learned per-parameter base b (the
  dense heads' biases play that part there):
  theta_i[chunk j] = b_j + m * (W^T f(v_i, c_j)) / sqrt(M). phi holds hidden x C
  head weights and the M x C base.

Either way theta_i = (a shared base) + (a head's reading of client i's
features); the features are unit-norm, so a step's size does not depend on
how the MLP happens to scale them.
"""

import collections
import math
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

LAYOUTS = ('dense', 'chunked')


def glorot_std(shape: Sequence[int]) -> float:
    """The standard deviation of Keras's Glorot initialisation of a weight tensor of `shape`; 0 for a vector.

    Args:
      shape: the tensor's shape (a kernel `[in, out]`, a convolution `[kh, kw, in, out]`, or a bias `[n]`).

    Returns:
      sqrt(2 / (fan_in + fan_out)), fans as Keras counts them; 0.0 for rank 1 (biases start at zero).
    """
    if len(shape) < 2:
        return 0.0
    receptive = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
    return math.sqrt(2.0 / (receptive * (shape[-2] + shape[-1])))


def _on_sphere(rng: np.random.Generator, count: int, dim: int) -> np.ndarray:
    """`[count, dim]` float32: Gaussian directions scaled to the norm sqrt(dim)."""
    draws = rng.normal(size=(count, dim))
    return (draws / np.linalg.norm(draws, axis=1, keepdims=True) * math.sqrt(dim)).astype(np.float32)


def default_embedding_dim(num_clients: int) -> int:
    """The paper's embedding size.

    Args:
      num_clients: N.

    Returns:
      1 + N / 4, rounded down.
    """
    return 1 + num_clients // 4


class HyperNetwork:
    """The layout of phi = <embeddings, mlp, heads> for one target model, and its TF code.

    Attributes:
      shapes: the target's weight shapes, in Keras order (the packed order).
      num_params: D.
      layout: 'dense' or 'chunked'.
      chunk_size: C (chunked), or D (dense).
      num_chunks: M (chunked), or 1.
      stds: the Glorot scale of each weight tensor (0 for a bias).
      reference_std: s_ref, the chunked head's scale.
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        num_clients: int,
        *,
        embedding_dim: int,
        hidden_units: int = 100,
        hidden_layers: int = 3,
        layout: str = 'dense',
        chunk_size: int = 10_000,
        chunk_embedding_dim: int = 8,
        seed: int = 0,
    ):
        """Fixes the layout and draws the small parts of phi (embeddings, MLP) with numpy.

        Args:
          shapes: the target model's trainable weight shapes, in Keras order.
          num_clients: N, one embedding v_i each.
          embedding_dim: the size of v_i.
          hidden_units: the MLP's width.
          hidden_layers: the MLP's hidden layers (each linear then ReLU).
          layout: 'dense' or 'chunked'.
          chunk_size: C, for the chunked layout.
          chunk_embedding_dim: the size of c_j, for the chunked layout.
          seed: seeds every initial value of phi.

        Raises:
          ValueError: an unknown layout (one line).
        """
        if layout not in LAYOUTS:
            raise ValueError(f'layout must be one of {", ".join(LAYOUTS)}, got {layout!r}')
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.num_params = sum(self.sizes)
        self.num_clients = num_clients
        self.layout = layout
        self.hidden_units = hidden_units
        self.seed = seed
        chunked = layout == 'chunked'
        self.chunk_size = chunk_size if chunked else self.num_params
        self.num_chunks = -(-self.num_params // chunk_size) if chunked else 1
        rng = np.random.default_rng(seed)
        # v_i: N(0, I) directions at the norm sqrt(E) (the paper's code draws N(0, I)); the c_j likewise. With the
        # MLP's zero biases h is positively homogeneous at round 0, so equal norms give every client's model the
        # same scale.
        self.initial_embeddings = _on_sphere(rng, num_clients, embedding_dim)
        self.initial_chunks = _on_sphere(rng, self.num_chunks, chunk_embedding_dim)
        width = [embedding_dim + (chunk_embedding_dim if chunked else 0)] + [hidden_units] * hidden_layers
        self.initial_mlp = []
        for fan_in, fan_out in zip(width[:-1], width[1:]):
            limit = math.sqrt(6.0 / (fan_in + fan_out))  # Glorot uniform
            self.initial_mlp += [
                rng.uniform(-limit, limit, size=(fan_in, fan_out)).astype(np.float32),
                np.zeros(fan_out, np.float32),
            ]
        stds = [glorot_std(s) for s in self.shapes]
        kernels = [(n, s) for n, s in zip(self.sizes, stds) if s > 0]
        # s_ref: the root mean square Glorot scale over the kernels' parameters (the chunked head's scale).
        self.reference_std = (
            math.sqrt(sum(n * s * s for n, s in kernels) / sum(n for n, _ in kernels)) if kernels else 0.1
        )
        self.stds = stds

    # --- sizes --------------------------------------------------------------------------------------------

    def parameter_count(self) -> int:
        """|phi|.

        Returns:
          Every parameter of the hypernetwork (embeddings, chunk embeddings, MLP, heads).
        """
        phi = self.shapes_of_phi()
        shapes = [phi['embeddings'], *phi['mlp'], *phi['heads']]
        return sum(int(np.prod(s)) for s in shapes)

    def shapes_of_phi(self) -> collections.OrderedDict:
        """phi's structure.

        Returns:
          phi's nested structure with each leaf's shape in its place.
        """
        heads = []
        if self.layout == 'dense':
            for size in self.sizes:
                heads += [(self.hidden_units, size), (size,)]
        else:
            heads = [
                self.initial_chunks.shape,
                (self.hidden_units, self.chunk_size),
                (self.num_chunks, self.chunk_size),
            ]
        return collections.OrderedDict(
            embeddings=self.initial_embeddings.shape, mlp=[w.shape for w in self.initial_mlp], heads=heads
        )

    # --- initial phi (TF code) ----------------------------------------------------------------------------

    def initial(self) -> collections.OrderedDict:
        """phi at round 0 (TF code).

        The heads are drawn so that the generated weights have the target's
        usual scale: the heads read unit-norm features (the MLP's last hidden
        layer, normalised), so dense, head t ~ N(0, s_t^2) with s_t the Glorot
        scale of weight tensor t (0 for a bias, which so starts at 0) gives
        weights of scale s_t; chunked, the shared head ~ N(0, s_ref^2) and each
        generated offset is multiplied by s_t / s_ref (1 for a bias) and
        1 / sqrt(M), on a base b ~ N(0, s_t^2 (1 - 1 / M)) (0 for a bias):
        the same variance s_t^2.

        Returns:
          `<embeddings [N, E], mlp [W_1, b_1, ...], heads [...]>`.
        """
        heads = []
        if self.layout == 'dense':
            for k, (size, std) in enumerate(zip(self.sizes, self.stds)):
                kernel = tf.random.stateless_normal([self.hidden_units, size], seed=[self.seed, k]) * std
                heads += [kernel, tf.zeros([size])]
        else:
            kernel = tf.random.stateless_normal([self.hidden_units, self.chunk_size], seed=[self.seed, 0])
            # Var(theta) = Var(b) + s_t^2 / M = s_t^2: the base carries 1 - 1/M of the scale (0 for a bias).
            share = math.sqrt(1.0 - 1.0 / self.num_chunks)
            base = [
                tf.random.stateless_normal([size], seed=[self.seed, k + 1]) * std * share
                for k, (size, std) in enumerate(zip(self.sizes, self.stds))
            ]
            base = tf.pad(tf.concat(base, 0), [[0, self.num_chunks * self.chunk_size - self.num_params]])
            heads = [
                tf.constant(self.initial_chunks),
                kernel * self.reference_std,
                tf.reshape(base, [self.num_chunks, self.chunk_size]),
            ]
        return collections.OrderedDict(
            embeddings=tf.constant(self.initial_embeddings),
            mlp=[tf.constant(w) for w in self.initial_mlp],
            heads=heads,
        )

    # --- h(v; phi) (TF code) ------------------------------------------------------------------------------

    def _features(self, mlp, inputs):
        hidden = inputs
        for kernel, bias in zip(mlp[::2], mlp[1::2]):
            hidden = tf.nn.relu(tf.matmul(hidden, kernel) + bias)
        # Unit-norm features: every client's generated model has the heads' scale, and a head's step of rate
        # alpha moves theta_i by alpha (||f||^2 + 1) = 2 alpha times its own part of the direction.
        return tf.math.l2_normalize(hidden, axis=-1)

    def _multiplier(self) -> tf.Tensor:
        """[D]: s_t / s_ref over the parameters of each kernel t, 1 over the biases (chunked layout)."""
        parts = [tf.fill([n], s / self.reference_std if s > 0 else 1.0) for n, s in zip(self.sizes, self.stds)]
        return tf.concat(parts, axis=0)

    def generate(self, phi, indices: tf.Tensor) -> tf.Tensor:
        """theta_i = h(v_i; phi) for each index, packed (TF code).

        Args:
          phi: the hypernetwork's values (`initial`'s structure).
          indices: int32 `[K]`, client indices in [0, N).

        Returns:
          float32 `[K, D]`, row k the packed weights of client `indices[k]`'s model.
        """
        v = tf.gather(phi['embeddings'], indices)  # [K, E]
        heads = phi['heads']
        if self.layout == 'dense':
            features = self._features(phi['mlp'], v)  # [K, H]
            return tf.concat([tf.matmul(features, w) + b for w, b in zip(heads[::2], heads[1::2])], axis=1)
        chunks, kernel, base = heads
        k, m = tf.shape(v)[0], self.num_chunks
        inputs = tf.concat(
            [tf.repeat(v[:, tf.newaxis, :], m, axis=1), tf.tile(chunks[tf.newaxis], [k, 1, 1])], axis=2
        )  # [K, M, E + E_c]: [v_i, c_j]
        features = self._features(phi['mlp'], tf.reshape(inputs, [k * m, -1]))
        offset = tf.reshape(tf.matmul(features, kernel), [k, m * self.chunk_size])[:, : self.num_params]
        base = tf.reshape(base, [-1])[: self.num_params]
        # 1 / sqrt(M): a step of the shared head, summed over M chunks, moves a chunk by about as much as the base.
        return base + offset * (self._multiplier() / math.sqrt(m))

    def gradient(self, phi, ids: tf.Tensor, deltas: tf.Tensor):
        """The mean over the round's clients of (grad_phi theta_i)^T (theta_i - theta_i_tilde) (TF code).

        The vector-Jacobian product of `generate` with -delta theta_i as the
        output gradient of row i: an optimizer step along it is the paper's
        phi <- phi - alpha (grad_phi theta_i)^T delta theta_i (and v_i alike),
        averaged over the round's clients.

        Args:
          phi: the hypernetwork's values.
          ids: int32 `[K]`, the clients of the rows (-1: an empty row, which adds nothing).
          deltas: float32 `[K, D]`, row k delta theta = theta_tilde - theta of client `ids[k]`.

        Returns:
          phi's structure of dense gradients.
        """
        real = tf.cast(ids >= 0, tf.float32)
        weights = real / tf.maximum(tf.reduce_sum(real), 1.0)
        leaves = tf.nest.flatten(phi)
        with tf.GradientTape() as tape:
            tape.watch(leaves)
            theta = self.generate(phi, tf.maximum(ids, 0))
        grads = tape.gradient(theta, phi, output_gradients=-deltas * weights[:, tf.newaxis])
        return tf.nest.map_structure(
            lambda g, p: tf.zeros_like(p) if g is None else tf.convert_to_tensor(g), grads, phi
        )


def sizes(
    shapes,
    num_clients: int,
    *,
    embedding_dim: int,
    hidden_units: int,
    hidden_layers: int,
    chunk_size: int,
    chunk_embedding_dim: int,
) -> collections.OrderedDict:
    """|phi| of both layouts for one target, without building either.

    Args:
      shapes: the target model's weight shapes.
      num_clients: N.
      embedding_dim: the size of v_i.
      hidden_units: the MLP's width.
      hidden_layers: the MLP's depth.
      chunk_size: the chunked layout's parameters per chunk.
      chunk_embedding_dim: the size of a chunk's embedding.

    Returns:
      `<dense=parameters, chunked=parameters>`.
    """
    num_params = sum(int(np.prod(s)) for s in shapes)
    mlp_dense = (embedding_dim + 1) * hidden_units + (hidden_layers - 1) * (hidden_units + 1) * hidden_units
    num_chunks = -(-num_params // chunk_size)
    embeddings = num_clients * embedding_dim
    dense = embeddings + mlp_dense + (hidden_units + 1) * num_params
    chunked = (
        embeddings
        + mlp_dense
        + chunk_embedding_dim * hidden_units  # the first layer's extra inputs
        + num_chunks * chunk_embedding_dim
        + hidden_units * chunk_size
        + num_chunks * chunk_size  # the base
    )
    return collections.OrderedDict(dense=dense, chunked=chunked)
