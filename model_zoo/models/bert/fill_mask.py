"""Fill in masked tokens with a pre-trained BERT: the most likely ids at every [MASK].

One fixed input shape per seq_length: the sequence is right-padded with id 0 (masked out
of attention) and the prediction positions are padded to seq_length entries, so a
graph-mode network compiles once and is reused for every sequence.
"""

import weakref

import numpy as np
import mindspore as ms

from .model import LogitsCell

# One compiled logits view per network (a new wrapper would compile the graph again).
_LOGITS_CELLS = weakref.WeakKeyDictionary()


def _logits_cell(network):
    if isinstance(network, LogitsCell):
        return network
    try:
        cell = _LOGITS_CELLS.get(network)
        if cell is None:
            cell = _LOGITS_CELLS[network] = LogitsCell(network)
        return cell
    except TypeError:  # not weak-referenceable or not hashable: wrap it each time
        return LogitsCell(network)


def fill_mask(network, input_ids, *, mask_id: int, top_k: int = 5, seq_length: int,
              token_type_ids=None):
    """The top-k ids at every position of `input_ids` equal to `mask_id`.

    Args:
        network: a BertForPreTraining (or a LogitsCell around one). It is run in eval mode
            (no dropout) and put back in training mode afterwards if it was.
        input_ids: one sequence of ids, already holding [CLS] ... [SEP] as wanted.
        mask_id: the [MASK] id (config.mask_token_id).
        top_k: ids to return per masked position, best first (capped at the vocabulary).
        seq_length: the model's input length (config.seq_length).
        token_type_ids: optional segment ids of the same length (default all 0).

    Returns:
        [(position, [ids best first]), ...] for the masked positions in order.

    Raises:
        ValueError: empty or too long sequence, no mask_id in it, top_k < 1, token_type_ids
            of another length.
    """
    ids = [int(token) for token in np.asarray(input_ids).reshape(-1)]
    if not ids:
        raise ValueError("the sequence is empty: give at least [CLS] [MASK] [SEP]")
    if int(seq_length) != seq_length or seq_length < 1:
        raise ValueError(f"seq_length must be an integer >= 1, got {seq_length!r}")
    seq_length = int(seq_length)
    if len(ids) > seq_length:
        raise ValueError(f"the sequence has {len(ids)} ids, more than seq_length={seq_length}")
    if int(top_k) != top_k or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    positions = [index for index, token in enumerate(ids) if token == int(mask_id)]
    if not positions:
        raise ValueError(f"the sequence holds no mask id {mask_id}: nothing to fill in")
    types = [0] * len(ids)
    if token_type_ids is not None:
        types = [int(t) for t in np.asarray(token_type_ids).reshape(-1)]
        if len(types) != len(ids):
            raise ValueError(f"token_type_ids has {len(types)} entries, input_ids {len(ids)}")

    inputs = np.zeros((1, seq_length), np.int32)
    inputs[0, :len(ids)] = ids
    segments = np.zeros((1, seq_length), np.int32)
    segments[0, :len(types)] = types
    attention_mask = np.zeros((1, seq_length), np.int32)
    attention_mask[0, :len(ids)] = 1
    gather = np.zeros((1, seq_length), np.int32)  # unused entries point at position 0
    gather[0, :len(positions)] = positions

    cell = _logits_cell(network)
    was_training = cell.network.training
    cell.set_train(False)
    try:
        mlm_logits, _ = cell(ms.Tensor(inputs), ms.Tensor(segments), ms.Tensor(attention_mask),
                             ms.Tensor(gather))
    finally:
        if was_training:
            cell.set_train(True)
    logits = mlm_logits.asnumpy()[:len(positions)]
    k = min(int(top_k), logits.shape[-1])
    return [(position, [int(i) for i in np.argsort(-row, kind="stable")[:k]])
            for position, row in zip(positions, logits)]


def _piece(tokenizer, token_id: int) -> str:
    if hasattr(tokenizer, "id_to_piece"):
        return str(tokenizer.id_to_piece(token_id))
    return str(tokenizer.decode([token_id]))


def format_fill_mask(results, tokenizer=None) -> str:
    """Lines `mask <position>: <id> <id> ...`, followed by the tokens when a tokenizer
    (an object with `id_to_piece` or `decode`) is given, e.g. `mask 3: 17 42 -> 'the' 'a'`."""
    lines = []
    for position, ids in results:
        line = f"mask {position}: " + " ".join(str(i) for i in ids)
        if tokenizer is not None:
            line += " -> " + " ".join(repr(_piece(tokenizer, i)) for i in ids)
        lines.append(line)
    return "\n".join(lines)
