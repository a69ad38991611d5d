"""How long an emulated answer is when the request does not say: a seeded output-length distribution.

Spec strings (``--output-len-dist``): ``max`` (run to max_tokens, like ``ignore_eos``), ``fixed:N``,
``uniform:LO:HI`` (inclusive), ``lognormal:MEAN:SIGMA`` (MEAN is the arithmetic mean, as in scenario files).
The length is independent of ``max_tokens``; the engine then stops at the smaller of the two.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


class OutputLenError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class OutputLenDist:
    kind: str
    a: float = 0.0
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> OutputLenDist:
        parts = spec.strip().lower().split(":")
        kind, args = parts[0], parts[1:]
        want = {"max": 0, "fixed": 1, "uniform": 2, "lognormal": 2}
        if kind not in want:
            raise OutputLenError(f"output length {spec!r}: kind must be one of {', '.join(want)}")
        if len(args) != want[kind]:
            raise OutputLenError(f"output length {spec!r}: {kind} takes {want[kind]} ':'-separated numbers")
        try:
            nums = [float(x) for x in args]
        except ValueError:
            raise OutputLenError(f"output length {spec!r}: not a number") from None
        if any(n <= 0 or not math.isfinite(n) for n in nums) or (kind == "uniform" and nums[0] > nums[1]):
            raise OutputLenError(f"output length {spec!r}: numbers must be positive (and LO <= HI)")
        return cls(kind, *nums)

    def sample(self, rng: random.Random) -> int | None:
        """Tokens the answer has on its own; None = until max_tokens."""
        if self.kind == "max":
            return None
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        mu = math.log(self.a) - self.b**2 / 2.0
        return max(1, round(rng.lognormvariate(mu, self.b)))
