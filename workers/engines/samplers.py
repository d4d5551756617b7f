"""Token samplers whose whole state is the sampler member of a Session Checkpoint (4.4, 6.8).

The state is (method, params, seed, step), exactly ``kvsp.records.Sampler``; the methods are
the registered ones: greedy, temperature, top-k, top-p and min-p. Step 3 of a resume (6.8)
"restores the sampler with the given method, parameters, seed, and step", so the randomness of
a step must be a function of (seed, step) alone, never of what was drawn before:

    u(seed, step) = first 53 bits of
                    SHA-256("KVSP-SAMPLER-1" || 0x00 || uint64(seed) || uint64(step)) / 2**53

and the token drawn is the first, in order of decreasing probability (equal probabilities:
lower token id first), at which the cumulative probability exceeds u. A sampler restored at
step k therefore draws, from the same logits, the tokens an uninterrupted one draws from step k.
Probabilities are computed in float64 on the CPU, whatever device produced the logits.

Only greedy decoding is ``deterministic`` in the sense of 4.4: the others draw from a
distribution, and a resumed instance whose logits differ in the last bits can draw differently.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import Any

import torch

from kvsp.problems import ProtocolError
from kvsp.records import SAMPLER_METHODS, Sampler

GREEDY = "greedy"
SAMPLER_TAG = b"KVSP-SAMPLER-1\x00"
_SEED_AND_STEP = struct.Struct(">QQ")
_UINT64_MAX = 2**64 - 1


def uniform(seed: int, step: int) -> float:
    """The uniform number in [0, 1) of a step, a function of (seed, step) alone."""
    if not 0 <= seed <= _UINT64_MAX or not 0 <= step <= _UINT64_MAX:
        raise ValueError("seed and step are unsigned 64-bit integers")
    digest = hashlib.sha256(SAMPLER_TAG + _SEED_AND_STEP.pack(seed, step)).digest()
    return (int.from_bytes(digest[:8], "big") >> 11) * 2.0**-53


class TokenSampler:
    """A sampler at a step: ``sample(logits)`` draws the token of the current step and advances.

    Parameters are checked as ``kvsp.records.Sampler`` checks them (ProtocolError
    ``kvsp-invalid-record``); a parameter this engine does not implement is refused the same
    way, because ignoring it would resume a session with a different sampler.
    """

    __slots__ = ("method", "params", "seed", "step", "_k", "_p", "_temperature")

    def __init__(
        self,
        method: str = GREEDY,
        params: Mapping[str, Any] | None = None,
        *,
        seed: int = 0,
        step: int = 0,
    ):
        record = Sampler(
            method=method,
            params=dict(params or {}),
            seed=seed,
            step=step,
            deterministic=method == GREEDY,
        )
        required, optional = SAMPLER_METHODS[method]
        unknown = sorted(set(record.params) - set(required) - set(optional))
        if unknown:
            raise ProtocolError(
                "kvsp-invalid-record",
                f"params: method {method!r} here takes no {', '.join(unknown)}",
            )
        self.method = method
        self.params: dict[str, Any] = record.params.to_json()
        self.seed = seed
        self.step = step
        self._temperature = float(self.params.get("temperature", 1.0))
        self._k = self.params.get("k")
        self._p = self.params.get("p")

    @classmethod
    def from_record(cls, record: Sampler) -> TokenSampler:
        """The sampler a checkpoint's sampler member describes, at its step."""
        return cls(record.method, record.params.to_json(), seed=record.seed, step=record.step)

    def to_record(self) -> Sampler:
        """The sampler member of a checkpoint taken now."""
        return Sampler(
            method=self.method,
            params=self.params,
            seed=self.seed,
            step=self.step,
            deterministic=self.deterministic,
        )

    @property
    def deterministic(self) -> bool:
        return self.method == GREEDY

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The probabilities (float64, CPU) this sampler draws from, zero outside the tokens
        its method keeps; for greedy, all of the mass on the first largest logit."""
        scores = logits.detach().to("cpu", torch.float64).reshape(-1)
        if scores.numel() == 0:
            raise ValueError("logits are empty")
        if torch.isnan(scores).any():
            raise ValueError("logits contain NaN")
        if self.method == GREEDY:
            probabilities = torch.zeros_like(scores)
            probabilities[int(torch.argmax(scores))] = 1.0
            return probabilities
        scores = scores / self._temperature
        if self.method == "top-k":
            order = torch.sort(scores, descending=True, stable=True).indices
            dropped = order[min(self._k, scores.numel()) :]
            scores = scores.index_fill(0, dropped, float("-inf"))
        probabilities = torch.softmax(scores, dim=0)
        if self.method == "top-p":
            # The nucleus: the most probable tokens until their mass reaches p.
            sorted_probabilities, order = torch.sort(probabilities, descending=True, stable=True)
            mass_before = torch.cumsum(sorted_probabilities, 0) - sorted_probabilities
            dropped = order[mass_before >= self._p]
            probabilities = probabilities.index_fill(0, dropped, 0.0)
        elif self.method == "min-p":
            floor = self._p * probabilities.max()
            probabilities = torch.where(probabilities >= floor, probabilities, 0.0)
        return probabilities / probabilities.sum()

    def choose(self, logits: torch.Tensor, step: int) -> int:
        """The token this sampler draws at ``step`` from ``logits``; changes nothing."""
        probabilities = self.distribution(logits)
        if self.method == GREEDY:
            return int(torch.argmax(probabilities))
        sorted_probabilities, order = torch.sort(probabilities, descending=True, stable=True)
        cumulative = torch.cumsum(sorted_probabilities, 0)
        point = uniform(self.seed, step) * float(cumulative[-1])
        index = int(torch.searchsorted(cumulative, cumulative.new_tensor([point]), right=True)[0])
        # Rounding can put the target on the last step of the sum; the draw stays among the
        # tokens that have probability.
        kept = int(torch.count_nonzero(sorted_probabilities))
        return int(order[min(index, kept - 1)])

    def sample(self, logits: torch.Tensor) -> int:
        """Draw the token of the current step, then advance one step."""
        token = self.choose(logits, self.step)
        self.step += 1
        return token

    def __repr__(self) -> str:
        return f"<TokenSampler {self.method} {self.params} seed={self.seed} step={self.step}>"
