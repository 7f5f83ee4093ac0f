"""Next-character prediction on text snippets, as TFF's Shakespeare task defines it.

The vocabulary and the special ids are TFF's own
(`tff.simulation.baselines.shakespeare`, `char_prediction_preprocessing`):
86 characters with ids 1..86 in `CHAR_VOCAB` order, 0 for padding, 87 for a
character outside the vocabulary (out-of-vocabulary, OOV), 88 for the
beginning and 89 for the end of a snippet; 90 ids in all.

A snippet becomes examples as in TFF's preprocessing: its bytes are mapped to
ids, framed as `[BOS] ids [EOS]`, padded with 0 to a multiple of
`sequence_length + 1` and cut into pieces of that length; each piece gives an
input (its first `sequence_length` ids) and a target (its last
`sequence_length`: the next character at every position).

Scored positions (the project's choice, stated in docs/data.md): a target
position counts, in the loss and in the accuracy, when its target is a
character, in the vocabulary or OOV; targets that are padding or the end of
the snippet are stored as `client_data.IGNORED_LABEL` and count nowhere (BOS
is never a target). TFF's baseline metric masks padding only, so it also
scores the end-of-snippet prediction. A piece with no scored position (a
snippet whose framed length is one more than a multiple of
`sequence_length + 1` leaves one: `[EOS, 0, ...]`) is dropped.
"""

import numpy as np
import tensorflow as tf
from tensorflow_federated.python.simulation.baselines.shakespeare import char_prediction_preprocessing

from tff_pfl.data import client_data

CHAR_VOCAB = tuple(char_prediction_preprocessing.CHAR_VOCAB)
PAD, OOV, BOS, EOS = char_prediction_preprocessing.get_special_tokens()
VOCAB_SIZE = len(CHAR_VOCAB) + 4
SEQUENCE_LENGTH = 80  # TFF's DEFAULT_SEQUENCE_LENGTH (McMahan et al., 2017)

# byte -> id: vocabulary characters 1..86, every other byte OOV (TFF splits snippets into bytes).
_BYTE_IDS = np.full(256, OOV, np.int32)
for _index, _char in enumerate(CHAR_VOCAB):
    _BYTE_IDS[ord(_char)] = _index + 1


def char_ids(snippet: bytes | str) -> np.ndarray:
    """The ids of a snippet's bytes (UTF-8 for a str), without BOS/EOS.

    Args:
      snippet: the text.

    Returns:
      int32 `[len(bytes)]`: 1..86 for vocabulary characters, `OOV` for any
      other byte.
    """
    data = snippet.encode('utf-8') if isinstance(snippet, str) else bytes(snippet)
    return _BYTE_IDS[np.frombuffer(data, np.uint8)]


def snippet_examples(snippets, sequence_length: int = SEQUENCE_LENGTH) -> tuple[np.ndarray, np.ndarray]:
    """Input and target sequences of a client's snippets (module docstring).

    Args:
      snippets: an iterable of bytes or str.
      sequence_length: L, the length of every input and target.

    Returns:
      `(x, y)`: int32 `[n, L]` inputs and int32 `[n, L]` targets, padding
      and end-of-snippet targets set to `client_data.IGNORED_LABEL`; pieces
      in snippet order.

    Raises:
      ValueError: `sequence_length` < 1.
    """
    if sequence_length < 1:
        raise ValueError(f'sequence_length must be >= 1, got {sequence_length}')
    piece = sequence_length + 1
    pieces = []
    for snippet in snippets:
        tokens = np.concatenate([[BOS], char_ids(snippet), [EOS]]).astype(np.int32)
        tokens = np.concatenate([tokens, np.zeros(-len(tokens) % piece, np.int32)])
        pieces.append(tokens.reshape(-1, piece))
    if not pieces:
        empty = np.zeros((0, sequence_length), np.int32)
        return empty, empty.copy()
    pieces = np.concatenate(pieces)
    x, y = pieces[:, :-1].copy(), pieces[:, 1:].copy()
    y[(y == PAD) | (y == EOS)] = client_data.IGNORED_LABEL
    keep = (y != client_data.IGNORED_LABEL).any(axis=1)
    return x[keep], y[keep]


def decode(ids) -> str:
    """Ids back to text: vocabulary characters as themselves, OOV as '?', specials dropped.

    Args:
      ids: an iterable of ids.

    Returns:
      The text.
    """
    chars = []
    for i in np.asarray(ids).reshape(-1):
        if 1 <= i <= len(CHAR_VOCAB):
            chars.append(CHAR_VOCAB[i - 1])
        elif i == OOV:
            chars.append('?')
    return ''.join(chars)


def generate(model, prompt: str, num_chars: int, *, temperature: float = 1.0, seed: int = 0) -> str:
    """Characters sampled from a next-character model, one at a time, after a prompt.

    The model reads `[BOS] prompt` (the last `SEQUENCE_LENGTH` ids of it and
    of what it has written so far) and the next character is drawn from the
    softmax of its logits at the last position, divided by `temperature`;
    the special ids (pad, BOS, EOS) are never drawn, OOV prints as '?'.

    Args:
      model: a Keras model mapping int32 `[1, L]` ids to `[1, L, VOCAB_SIZE]`
        logits (`char_gru`), holding the weights to sample from.
      prompt: the text to continue.
      num_chars: how many characters to write.
      temperature: > 0; lower is greedier.
      seed: seed of the draws.

    Returns:
      The written characters (without the prompt).
    """
    if temperature <= 0:
        raise ValueError(f'temperature must be > 0, got {temperature}')
    rng = np.random.default_rng(seed)
    ids = [BOS, *char_ids(prompt).tolist()]
    written = []
    allowed = np.zeros(VOCAB_SIZE, bool)
    allowed[1 : OOV + 1] = True  # characters and OOV
    # One graph for every step (the window is always SEQUENCE_LENGTH ids): calling the Keras model
    # eagerly runs its GRU step by step in Python, 12-14 times slower for char_gru.
    forward = tf.function(lambda x: model(x, training=False), autograph=False)
    for _ in range(num_chars):
        window = ids[-SEQUENCE_LENGTH:]
        x = np.zeros((1, SEQUENCE_LENGTH), np.int32)
        x[0, : len(window)] = window
        logits = np.asarray(forward(x))[0, len(window) - 1].astype(np.float64) / temperature
        logits[~allowed] = -np.inf
        p = np.exp(logits - logits.max())
        next_id = int(rng.choice(VOCAB_SIZE, p=p / p.sum()))
        ids.append(next_id)
        written.append(next_id)
    return decode(written)
