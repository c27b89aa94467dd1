"""The fake engine's deterministic model.

Like a transformer, it writes for each token, layer and KV head a K and a V
vector that depend on the token and every token before it (a hash of the
prefix), and it chooses each next token by reading KV from the cache: the
choice is a function of a running digest of every cached KV cell of the
sequence, read back from the paged cache. KV that a transfer corrupted, and
that the engine then uses, changes the text; KV that arrives intact gives
the text the same engine produces on its own, whatever the TP size and
block size of the engine that computed it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine_patch.hashing import MASK64, hash64, mix, splitmix64
from fake_engine.config import EngineConfig
from fake_engine.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE

# What generated tokens are made of: one ASCII byte each, so streamed text
# never splits a character.
_ALPHABET = b"etaoinshrdlucmfwypvbgkjqxz" + b" " * 6 + b".,"
# One position in this many has EOS for its likeliest token: sampled there,
# it ends the sequence unless ignored (``ignore_eos``), and under
# ``min_tokens`` the sampler masks it.
_EOS_ODDS = 128
# Differences between copies of a replicated head enter the digest with this
# odd factor: copies that agree add nothing, so a TP size that replicates
# heads gives the same text as one that does not.
_REPLICA_FACTOR = 0x9E3779B97F4A7C15
# Tokens per pass when generating KV, to bound temporaries.
_KV_CHUNK_TOKENS = 256

# Log probabilities: the token a position's value picks has probability in
# [0.5, 0.95); the rest of the mass halves from one other token to the next.
_DISTINCT_TOKENS = len(set(_ALPHABET))
# How many of a position's likeliest tokens a prompt token, a requested one
# or a sampled one is looked for among; one further down gets a rank past
# them (``_scored``).
_PROMPT_RANKS = 21

_C_PREFIX = 0xD6E8FEB86659FD93
_C_VALUE = 0xA0761D6478BD642F
_C_POSITION = 0xE7037ED1A0B428DB


class TokenLogprob(NamedTuple):
    """A token's log probability at a position, and its rank there (1: the
    likeliest), as vLLM's ``Logprob``."""

    token_id: int
    logprob: float
    rank: int


def _pick(value: int) -> int:
    """The likeliest token of the position whose value is ``value``."""
    if value % _EOS_ODDS == 0:
        return EOS_TOKEN_ID
    return _ALPHABET[(value >> 8) % len(_ALPHABET)]


def _likeliest(value: int, first: int, count: int) -> list[TokenLogprob]:
    """The ``count`` likeliest tokens of the position whose value is
    ``value``, ``first`` (the one it picks) first."""
    p_first = 0.5 + 0.45 * ((value >> 20) & 0xFFFF) / 65536
    out = [TokenLogprob(first, math.log(p_first), 1)]
    seen = {first}
    rest = 1.0 - p_first
    other = 0
    while len(out) < min(count, _DISTINCT_TOKENS):
        other += 1
        token = _ALPHABET[(mix(value ^ splitmix64(other)) >> 8) % len(_ALPHABET)]
        if token not in seen:
            seen.add(token)
            rest /= 2
            out.append(TokenLogprob(token, math.log(rest), len(out) + 1))
    return out


@dataclass(frozen=True)
class Processors:
    """What vLLM's logits processors do to a position's logits before greedy
    sampling, after its raw logprobs are taken: only ``allowed`` tokens are
    kept where set (``allowed_token_ids``), ``masked`` ones are dropped (stop
    tokens under ``min_tokens``, a bad word's last token), and ``bias`` is
    added (``logit_bias``)."""

    allowed: frozenset[int] | None = None
    masked: frozenset[int] = frozenset()
    bias: Mapping[int, float] = field(default_factory=dict)

    def keeps(self, token: int) -> bool:
        """Whether ``token``'s logit is left finite."""
        return token not in self.masked and (
            self.allowed is None or token in self.allowed
        )

    def changes(self, token: int) -> bool:
        """Whether the processors may turn greedy sampling from ``token``,
        the likeliest."""
        return bool(self.bias) or not self.keeps(token)


# No processor: greedy sampling takes the likeliest token.
NO_PROCESSORS = Processors()


def _sample(value: int, processors: Processors) -> TokenLogprob:
    """The token greedy sampling takes through ``processors`` at the
    position whose value is ``value``, with its raw log probability and
    rank (what vLLM reports for it): the kept token whose logprob plus bias
    is highest, the lowest id of equals, as argmax."""
    likeliest = _likeliest(value, _pick(value), _PROMPT_RANKS)
    keeps, bias = processors.keeps, processors.bias
    # The likeliest kept token without a bias: no other unbiased one beats it.
    best = next(
        (e for e in likeliest if keeps(e.token_id) and e.token_id not in bias), None
    )
    if best is None:
        rest = [
            _scored(value, t, likeliest)
            for t in range(VOCAB_SIZE)
            if keeps(t) and t not in bias
        ]
        best = min(rest, key=lambda e: (e.rank, e.token_id), default=None)
    candidates = [] if best is None else [best]
    candidates += [_scored(value, t, likeliest) for t in bias if keeps(t)]
    if not candidates:
        # Every logit is -inf: argmax takes token 0.
        return _scored(value, 0, likeliest)
    return max(
        candidates, key=lambda e: (e.logprob + bias.get(e.token_id, 0.0), -e.token_id)
    )


def _scored(value: int, token: int, likeliest: list[TokenLogprob]) -> TokenLogprob:
    """``token``'s log probability and rank at the position whose value is
    ``value`` and whose ``likeliest`` tokens are listed: its entry there, or
    one below the last of them (the same wherever it is asked for)."""
    entry = next((e for e in likeliest if e.token_id == token), None)
    if entry is not None:
        return entry
    below = 1 + mix(value ^ token) % 100
    floor = likeliest[-1].logprob - below * math.log(2)
    return TokenLogprob(token, floor, len(likeliest) + below)


def _signed(value: int) -> int:
    """A 64-bit word as int64."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _srl(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic)."""
    x = (x ^ _srl(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _srl(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _srl(x, 31)


def _odd_weights(shape: tuple[int, ...], domain: int) -> torch.Tensor:
    """Fixed odd int64 weights, one per index of ``shape``."""
    count = 1
    for size in shape:
        count *= size
    index = torch.arange(count, dtype=torch.int64) + _signed(domain << 48)
    return (_mix_tensor(index * _signed(_C_VALUE)) | 1).reshape(shape)


class FakeModel:
    """KV of tokens, and next tokens from KV read back from the cache."""

    def __init__(self, config: EngineConfig) -> None:
        self.num_layers = config.layers
        self.num_heads = config.kv_heads
        self.head_size = config.head_size
        self.dtype = config.torch_dtype
        self.cache_dtype = config.cache_dtype
        # 64-bit words per cell (one token, layer and head: K then V).
        self.words_per_cell = 2 * config.head_size * config.element_size // 8
        self._seed = hash64("kvguard-fake-model", config.model)
        self._value_keys = _odd_weights(
            (config.layers, config.kv_heads, 2, config.head_size), 1
        )
        self._cell_weights = _odd_weights(
            (config.layers, config.kv_heads, self.words_per_cell), 2
        )
        self._position_weights = torch.empty(0, dtype=torch.int64)

    def prefix_hashes(
        self, token_ids: Iterable[int], previous: int | None
    ) -> list[int]:
        """The prefix hash of each token: of it and every token before it,
        continuing from the previous token's (None: the sequence's start)."""
        state = self._seed if previous is None else previous
        hashes = []
        for token_id in token_ids:
            state = mix((state * _C_PREFIX + token_id + 1) & MASK64)
            hashes.append(state)
        return hashes

    def kv(self, prefix_hashes: list[int]) -> torch.Tensor:
        """KV of tokens from their prefix hashes: ``[tokens, layers, heads,
        2, head_size]`` in the KV cache's dtype (K then V)."""
        out = torch.empty(
            (len(prefix_hashes), self.num_layers, self.num_heads, 2, self.head_size),
            dtype=self.cache_dtype,
        )
        for start in range(0, len(prefix_hashes), _KV_CHUNK_TOKENS):
            chunk = prefix_hashes[start : start + _KV_CHUNK_TOKENS]
            seeds = torch.tensor([_signed(h) for h in chunk], dtype=torch.int64)
            # The prefix hash is already mixed: one odd multiply per value
            # spreads it, and the top 16 bits make a value in [-2, 2).
            bits = seeds.view(-1, 1, 1, 1, 1) * self._value_keys
            values = (bits >> 48).to(torch.float32).mul_(1 / 16384).to(self.dtype)
            if self.cache_dtype != self.dtype:
                values = values.view(self.cache_dtype)
            out[start : start + len(chunk)] = values
        return out

    def head_digests(self, cells: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Per token and head, the digest of cached cells: ``cells`` is
        ``[tokens, layers, len(heads), 2, head_size]`` as read from the
        cache, ``heads`` their global head indices. Returns int64
        ``[tokens, len(heads)]``."""
        num_tokens = cells.shape[0]
        words = cells.contiguous().view(torch.int64)
        words = words.reshape(num_tokens, self.num_layers, len(heads), -1)
        weights = self._cell_weights[:, heads, :]
        return (words * weights).sum(dim=(1, 3))

    def combine_heads(
        self, digests: dict[tuple[int, int], torch.Tensor], replicas: int
    ) -> torch.Tensor:
        """Per token, the digest over all heads from per-(head, copy)
        digests: copy 0 of each head, plus any difference of another copy
        from it (zero when the copies agree)."""
        total = torch.zeros_like(next(iter(digests.values())))
        for head in range(self.num_heads):
            first = digests[(head, 0)]
            total += first
            for copy in range(1, replicas):
                total += (digests[(head, copy)] - first) * _signed(_REPLICA_FACTOR)
        return total

    def position_weights(self, positions: torch.Tensor) -> torch.Tensor:
        """Odd int64 weights of absolute positions."""
        end = int(positions.max()) + 1 if len(positions) else 0
        if end > len(self._position_weights):
            size = max(end, 2 * len(self._position_weights), 1024)
            index = torch.arange(size, dtype=torch.int64)
            self._position_weights = _mix_tensor(index * _signed(_C_POSITION)) | 1
        return self._position_weights[positions]

    def fold(
        self,
        token_digests: torch.Tensor,
        positions: torch.Tensor,
        sequences: torch.Tensor,
        num_sequences: int,
    ) -> list[int]:
        """What reading tokens adds to their sequences' digests: per-token
        digests weighted by position, summed per sequence (``sequences``:
        each token's sequence index)."""
        weighted = token_digests * self.position_weights(positions)
        sums = torch.zeros(num_sequences, dtype=torch.int64)
        sums.index_add_(0, sequences, weighted)
        return [value & MASK64 for value in sums.tolist()]

    def next_token(
        self, digest: int, position: int, processors: Processors = NO_PROCESSORS
    ) -> int:
        """The token at ``position``, from the digest of the KV before it:
        the likeliest there, as greedy sampling through ``processors``
        takes it."""
        value = mix(digest ^ splitmix64(position))
        token = _pick(value)
        if processors.changes(token):
            return _sample(value, processors).token_id
        return token

    def logprobs(
        self,
        digest: int,
        position: int,
        *,
        count: int,
        processors: Processors = NO_PROCESSORS,
    ) -> list[TokenLogprob]:
        """The token :meth:`next_token` picks, then the ``count`` likeliest
        (the pick listed once): what vLLM returns for a sampled token when
        ``count`` top logprobs are asked. They are raw, vLLM's default, taken
        before the processors: another token than the pick may rank first."""
        value = mix(digest ^ splitmix64(position))
        likeliest = _likeliest(value, _pick(value), max(1, count))
        if not processors.changes(likeliest[0].token_id):
            return likeliest
        sampled = _sample(value, processors)
        top = {e.token_id: e for e in likeliest[:count]}
        return list({sampled.token_id: sampled, **top}.values())

    def requested_logprobs(
        self,
        digest: int,
        position: int,
        *,
        token_ids: Iterable[int],
        processors: Processors = NO_PROCESSORS,
    ) -> list[TokenLogprob]:
        """The token :meth:`next_token` picks (with its rank), then each of
        ``token_ids`` with its log probability there: what vLLM returns for
        a sampled token when ``logprob_token_ids`` are asked. As vLLM's
        ``append_logprobs_for_next_position`` ranks them, each requested
        token's rank is its place in ``token_ids``, and a token listed twice
        (or the pick listed again) keeps its first place and its last rank."""
        value = mix(digest ^ splitmix64(position))
        likeliest = _likeliest(value, _pick(value), _PROMPT_RANKS)
        sampled = likeliest[0]
        if processors.changes(sampled.token_id):
            sampled = _sample(value, processors)
        entries = {sampled.token_id: sampled}
        for rank, token in enumerate(token_ids, start=1):
            entries[token] = _scored(value, token, likeliest)._replace(rank=rank)
        return list(entries.values())

    def prompt_logprobs(
        self, token_ids: list[int], count: int
    ) -> list[list[TokenLogprob] | None]:
        """Per prompt token, its log probability and rank given the tokens
        before it, then the ``count`` likeliest tokens there (it only once):
        vLLM's prompt logprobs, None for the first token. A function of the
        prompt's prefix hashes, not of KV: a prompt is scored where it is
        computed."""
        hashes = self.prefix_hashes(token_ids, None)
        out: list[list[TokenLogprob] | None] = [None] if token_ids else []
        for position in range(1, len(token_ids)):
            value = mix(hashes[position - 1] ^ splitmix64(position))
            likeliest = _likeliest(value, _pick(value), _PROMPT_RANKS)
            token = token_ids[position]
            entry = _scored(value, token, likeliest)
            out.append([entry, *(e for e in likeliest[:count] if e.token_id != token)])
        return out
