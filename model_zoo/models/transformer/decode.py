"""Translation: greedy decoding and batched beam search with an incremental decoder.

The encoder runs once per batch; every decoder step feeds only the newest token and reuses
the cached keys and values of earlier positions (and the encoder's keys and values), so a
step costs the same at position 100 as at position 1. Each step writes its keys and values
into the caches in place; the caches are as long as the batch's length limit (in steps of
16), so attention spans only the positions a batch can reach. The cells compile once per
batch shape; the search itself (scores, beams, finished hypotheses) is plain numpy.
"""

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from model_zoo.nn.cache import step_inputs

from .model import CrossKeyValues, DecoderStep, Transformer

CACHE_STEP = 16


class Encoder(nn.Cell):
    """Source ids and mask -> (memory, source bias), as one compiled graph."""

    def __init__(self, transformer: Transformer):
        super().__init__(auto_prefix=False)
        self.transformer = transformer

    def construct(self, source_ids, source_mask):
        return self.transformer.encode(source_ids, source_mask)


class Translator:
    """Decodes with a trained Transformer (put in eval mode by the constructor).

    Args:
        transformer: the model.
        max_extra: a translation may be at most this many tokens longer than its source.
    """

    def __init__(self, transformer: Transformer, max_extra: int = None):
        transformer.set_train(False)
        config = transformer.config
        self.config = config
        self.encoder = Encoder(transformer)
        self.cross = CrossKeyValues(transformer)
        self.steps = {}
        self.max_extra = config.max_decode_extra if max_extra is None else max_extra
        self.max_len = config.seq_length + config.max_decode_extra + 1
        self.position_table = transformer.positions.table.asnumpy()
        attention = transformer.decoder_layers[0].self_attention.function
        self.heads = (attention.num_heads, attention.head_dim)
        # The caches hold keys and values as the attention computes them (fp16 with fp16
        # precision): BatchMatMul needs the query and the cached keys in one dtype.
        self.cache_dtype = attention.compute_dtype
        self.num_layers = config.num_layers

    def prepare(self, source_ids, source_mask, copies: int, length: int = None):
        """Encode, repeat each sentence `copies` times, and prepare empty caches of `length`
        positions (default: the batch's length limit, in steps of CACHE_STEP)."""
        memory, source_bias = self.encoder(Tensor(source_ids, ms.int32),
                                           Tensor(source_mask, ms.int32))
        if copies > 1:
            index = Tensor(np.repeat(np.arange(source_ids.shape[0]), copies), ms.int32)
            memory, source_bias = ops.gather(memory, index, 0), ops.gather(source_bias, index, 0)
        cross_keys, cross_values = self.cross(memory)
        rows = source_ids.shape[0] * copies
        length = length or self.cache_length(source_mask)
        shape = (rows, self.heads[0], length, self.heads[1])
        # one tensor per cache: a step writes into them in place
        caches = tuple(tuple(Tensor(np.zeros(shape, np.float32), self.cache_dtype)
                             for _ in range(self.num_layers)) for _ in ("keys", "values"))
        return caches, (cross_keys, cross_values, source_bias)

    def cache_length(self, source_mask) -> int:
        """Cache positions for a batch: its length limit, rounded up to CACHE_STEP."""
        return min(self.max_len, -(-self._length_limit(source_mask) // CACHE_STEP) * CACHE_STEP)

    def step_cell(self, top_k: int) -> DecoderStep:
        """The decoder step that keeps `top_k` continuations (compiled once per top_k); a
        step for more than one continuation reorders the caches (beam search)."""
        if top_k not in self.steps:
            self.steps[top_k] = DecoderStep(self.encoder.transformer, top_k,
                                            reorder=top_k > 1)
        return self.steps[top_k]

    def step_arguments(self, tokens, parents, position, caches, cross) -> tuple:
        """The DecoderStep inputs that feed `tokens` (one per hypothesis) at `position`."""
        rows, heads, length, _ = caches[0][0].shape
        write_index, step_bias = step_inputs(position, length, rows, heads)
        encoding = Tensor(self.position_table[position:position + 1])
        # mutable: tuples of tensors are inputs of the compiled step, not constants of it
        # (a constant would recompile the step at every call)
        return (Tensor(tokens.reshape(-1, 1), ms.int32), Tensor(parents, ms.int32),
                write_index, step_bias, encoding, ms.mutable(caches[0]), ms.mutable(caches[1]),
                ms.mutable(cross[0]), ms.mutable(cross[1]), cross[2])

    def _step(self, tokens, parents, position, caches, cross, top_k):
        """Log-probabilities and ids of each hypothesis' `top_k` best next tokens."""
        values, ids, keys, cache_values = self.step_cell(top_k)(
            *self.step_arguments(tokens, parents, position, caches, cross))
        return values.asnumpy(), ids.asnumpy(), (keys, cache_values)

    def _length_limit(self, source_mask) -> int:
        return min(int(source_mask.sum(axis=1).max()) + self.max_extra, self.max_len - 1)

    def greedy(self, source_ids, source_mask) -> list:
        """The most likely token at every step; one id list per sentence (eos excluded)."""
        config = self.config
        caches, cross = self.prepare(source_ids, source_mask, 1)
        batch = source_ids.shape[0]
        tokens = np.full(batch, config.bos_token_id, np.int64)
        rows = np.arange(batch)
        outputs = [[] for _ in range(batch)]
        done = np.zeros(batch, bool)
        for position in range(self._length_limit(source_mask)):
            _, ids, caches = self._step(tokens, rows, position, caches, cross, 1)
            tokens = ids[:, 0]
            for row in np.flatnonzero(~done):
                if tokens[row] == config.eos_token_id:
                    done[row] = True
                else:
                    outputs[row].append(int(tokens[row]))
            if done.all():
                break
        return outputs

    def beam_search(self, source_ids, source_mask, beam_size: int = None,
                    length_penalty: float = None) -> list:
        """Beam search with the GNMT length penalty ((5 + length) / 6) ** alpha.

        Each sentence keeps `beam_size` live hypotheses; a hypothesis that emits eos is
        finished and scored by its log-probability divided by the length penalty. A sentence
        stops when it has `beam_size` finished hypotheses and no live one can still beat the
        best, or at the length limit. Returns the best id list per sentence (eos excluded).
        """
        config = self.config
        beam = beam_size or config.beam_size
        alpha = config.length_penalty if length_penalty is None else length_penalty
        batch = source_ids.shape[0]
        caches, cross = self.prepare(source_ids, source_mask, beam)
        scores = np.full((batch, beam), -np.inf)
        scores[:, 0] = 0.0
        sequences = np.zeros((batch, beam, 0), np.int64)
        tokens = np.full(batch * beam, config.bos_token_id, np.int64)
        rows = np.arange(batch * beam)
        finished = [[] for _ in range(batch)]
        done = np.zeros(batch, bool)
        limit = self._length_limit(source_mask)

        def penalty(length):
            return ((5.0 + length) / 6.0) ** alpha

        for position in range(limit):
            # 2 x beam continuations per hypothesis: even if `beam` of them end, `beam` live
            # hypotheses remain.
            top_scores, top_ids, caches = self._step(tokens, rows, position, caches, cross,
                                                     2 * beam)
            width = top_scores.shape[-1]
            candidates = (scores[:, :, None] + top_scores.reshape(batch, beam, width)).reshape(
                batch, -1)
            candidate_ids = top_ids.reshape(batch, -1)
            order = np.argsort(-candidates, axis=1, kind="stable")[:, :2 * beam]
            new_scores = np.full((batch, beam), -np.inf)
            parents = np.zeros((batch, beam), np.int64)
            new_tokens = np.full((batch, beam), config.pad_token_id, np.int64)
            for row in range(batch):
                if done[row]:
                    continue
                kept = 0
                for flat in order[row]:
                    score = candidates[row, flat]
                    if not np.isfinite(score):
                        break
                    parent, token = int(flat) // width, int(candidate_ids[row, flat])
                    if token == config.eos_token_id:
                        finished[row].append((score / penalty(position + 1),
                                              sequences[row, parent].tolist()))
                        continue
                    new_scores[row, kept], parents[row, kept] = score, parent
                    new_tokens[row, kept] = token
                    kept += 1
                    if kept == beam:
                        break
                best_finished = max((s for s, _ in finished[row]), default=-np.inf)
                best_alive = new_scores[row].max() / penalty(limit)
                if len(finished[row]) >= beam and best_finished >= best_alive:
                    done[row] = True
            if done.all():
                break
            rows = (np.arange(batch)[:, None] * beam + parents).reshape(-1)
            sequences = np.concatenate(
                [sequences[np.arange(batch)[:, None], parents], new_tokens[:, :, None]], axis=2)
            scores = np.where(done[:, None], -np.inf, new_scores)
            tokens = new_tokens.reshape(-1)
        results = []
        for row in range(batch):
            if not finished[row]:  # length limit reached: take the live hypotheses
                finished[row] = [(scores[row, k] / penalty(sequences.shape[2]),
                                  sequences[row, k].tolist()) for k in range(beam)
                                 if np.isfinite(scores[row, k])]
            results.append(max(finished[row], key=lambda item: item[0])[1])
        return results
