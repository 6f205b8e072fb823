"""A deterministic local training corpus and the batches each worker reads from it.

Nothing is downloaded: the corpus is generated from a seed, the same bytes on every
worker. It is text-like so that a small GPT has something to learn: a few thousand
pseudo-words built from syllables, strung into sentences by a first-order Markov chain
with Zipf-distributed transitions (a word strongly predicts the next few), punctuation
and capitalisation. Tokens are bytes (taken modulo the vocabulary when it is smaller than
256). Loss starts at ln(vocab) and falls well below it within a few hundred steps.

Batches: step t draws `global_batch` windows of seq_len + 1 tokens at offsets from a
generator seeded by (seed, t). Replica r reads windows [r·m·b, (r+1)·m·b) as its m
micro-batches of b; a single process (dp = 1) reads them all, so every layout sees the
same data and a parallel run can follow a single-process one exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

CORPUS_BYTES = 4 << 20  # 4 MiB
CPU = torch.device("cpu")
WORDS = 3000
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "ch", "qu", "st"]


@lru_cache(maxsize=4)
def corpus(seed: int = 0, size: int = CORPUS_BYTES) -> np.ndarray:
    """`size` bytes of generated text, identical for the same seed."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4, size=WORDS)
    words = [
        "".join(SYLLABLES[j] for j in rng.integers(0, len(SYLLABLES), size=n)) for n in lengths
    ]
    # Each word's successors: 8 candidates with Zipf weights, so contexts are predictable.
    successors = rng.integers(0, WORDS, size=(WORDS, 8))
    weights = 1.0 / np.arange(1, 9)
    weights /= weights.sum()
    # Random draws in bulk (one call each), then a cheap sequential walk of the chain.
    n = size // 3 + 16  # words are at least 3 bytes with their separator
    picks = rng.choice(8, size=n, p=weights)
    commas = rng.random(n) < 0.08
    sentence_lengths = rng.integers(5, 15, size=n // 5 + 1)
    endings = rng.choice([". ", ". ", "! ", "? "], size=len(sentence_lengths))
    pieces: list[str] = []
    total, word, sentence, left, start = 0, int(rng.integers(0, WORDS)), 0, 0, True
    left = int(sentence_lengths[0])
    for i in range(n):
        text = words[word].capitalize() if start else words[word]
        left -= 1
        if left == 0:
            text += str(endings[sentence])
            sentence += 1
            left = int(sentence_lengths[sentence])
            start = True
        else:
            text += ", " if commas[i] else " "
            start = False
        pieces.append(text)
        total += len(text)
        if total >= size:
            break
        word = int(successors[word, picks[i]])
    return np.frombuffer("".join(pieces).encode()[:size], dtype=np.uint8).copy()


@dataclass(frozen=True)
class BatchSource:
    """The micro-batches a replica reads at a step."""

    seq_len: int
    vocab: int
    global_batch: int
    micro_batch: int
    dp: int
    seed: int = 0
    device: torch.device = CPU  # where the batches are made

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    def windows(self, step: int) -> torch.Tensor:
        """All `global_batch` windows of step `step`, shape (global_batch, seq_len + 1)."""
        data = corpus(self.seed)
        g = np.random.default_rng([self.seed, step])
        offsets = g.integers(0, len(data) - self.seq_len - 1, size=self.global_batch)
        rows = np.stack([data[o : o + self.seq_len + 1] for o in offsets]).astype(np.int64)
        tokens = torch.as_tensor(rows, device=self.device)
        return tokens % self.vocab if self.vocab < 256 else tokens

    def for_replica(self, step: int, replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) of each of the replica's micro-batches, in order."""
        per_replica = self.micro_batches * self.micro_batch
        mine = self.windows(step)[replica * per_replica : (replica + 1) * per_replica]
        out = []
        for j in range(self.micro_batches):
            w = mine[j * self.micro_batch : (j + 1) * self.micro_batch]
            out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
        return out
