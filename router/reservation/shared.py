"""One output-length predictor for every router replica, through Redis.

Each replica learns locally (:class:`SharedPredictor` also keeps what it observed since its last push,
the *delta*) and, every few seconds, sends the delta and reads back the shared state in one Lua script:
for each key of the delta, the shared histogram is first aged by the delta's observation count, then
gains the delta's counts — the same rule as :meth:`Predictor.merge`, so the shared copy is what one
router that saw every request would hold (up to the order of the replicas' batches). The replica then
adopts the shared state plus whatever it observed while the script ran.

Bounded: the shared hash holds at most ``max_keys`` keys (the global key is always accepted); keys past
the cap stay local to the replica that saw them. Best effort: a failed exchange keeps the delta for the
next one and is logged; the local predictor keeps answering. A reply lost after the script ran makes
the next push count that delta twice (a slightly faster forgetting, nothing worse).

Redis layout: one HASH ``kvr:{namespace}:pred``, key level → ``"n bin:count bin:count ..."`` (``n``: the
observations behind the key, counts decayed so that the newest observation weighs 1).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.reservation.predictor import Predictor, PredictorConfig, RequestKey

log = logging.getLogger(__name__)

DEFAULT_SHARED_MAX_KEYS: Final[int] = 512
GLOBAL_LEVEL: Final[str] = "*|*|*|*"

# KEYS[1]: the hash. ARGV: half_life_obs, max_keys, global level, then (level, encoded delta) pairs.
# Returns HGETALL of the hash (strings only: a Lua number would come back truncated to an integer).
PUSH_PULL_LUA: Final[str] = """
local key, half_life, max_keys, global = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local function parse(v)
  local n, bins, first = 0, {}, true
  for tok in string.gmatch(v, '%S+') do
    if first then
      n = tonumber(tok) or 0
      first = false
    else
      local b, c = string.match(tok, '^(%d+):(%S+)$')
      local count = tonumber(c)
      if b and count and count > 0 then bins[tonumber(b)] = count end
    end
  end
  return n, bins
end
local function encode(n, bins)
  local order = {}
  for b in pairs(bins) do order[#order + 1] = b end
  table.sort(order)
  local parts = {string.format('%d', n)}
  for _, b in ipairs(order) do parts[#parts + 1] = string.format('%d:%.17g', b, bins[b]) end
  return table.concat(parts, ' ')
end
local size = redis.call('HLEN', key)
for i = 4, #ARGV - 1, 2 do
  local level = ARGV[i]
  local dn, dbins = parse(ARGV[i + 1])
  local cur = redis.call('HGET', key, level)
  if cur or size < max_keys or level == global then
    local n, bins = 0, {}
    if cur then n, bins = parse(cur) else size = size + 1 end
    local factor = 2 ^ (-dn / half_life)
    local out = {}
    for b, c in pairs(bins) do
      local aged = c * factor
      if aged > 1e-12 then out[b] = aged end
    end
    for b, c in pairs(dbins) do out[b] = (out[b] or 0) + c end
    redis.call('HSET', key, level, encode(n + dn, out))
  end
end
return redis.call('HGETALL', key)
"""


def encode_histogram(bins: Mapping[str, float]) -> str:
    """``{"n": obs, "bin": count}`` (a :meth:`DecayedHistogram.to_dict`) → ``"n bin:count ..."``."""
    parts = [str(int(bins.get("n", 0)))]
    parts += [f"{b}:{c!r}" for b, c in bins.items() if b != "n" and c > 0]
    return " ".join(parts)


def decode_histogram(text: str) -> dict[str, float]:
    """Inverse of :func:`encode_histogram`; ValueError on anything malformed."""
    head, *rest = text.split() or ["0"]
    out: dict[str, float] = {"n": int(head)}
    for token in rest:
        b, sep, c = token.partition(":")
        if not sep or not b.isdigit():
            raise ValueError(f"bad histogram entry {token!r}")
        out[b] = float(c)
    return out


@dataclass(slots=True)
class SharedPredictor(Predictor):
    """A :class:`Predictor` that also records its own observations since the last :meth:`take_delta`."""

    _delta: Predictor | None = None

    def observe(self, key: RequestKey, output_tokens: int) -> None:
        Predictor.observe(self, key, output_tokens)  # explicit: zero-arg super() fails in slots dataclasses
        if self._delta is None:
            self._delta = Predictor(self.config)
        self._delta.observe(key, output_tokens)

    def take_delta(self) -> Predictor:
        """What was observed since the last call (possibly empty); recording starts afresh."""
        delta, self._delta = self._delta, None
        return delta if delta is not None else Predictor(self.config)

    def put_back(self, delta: Predictor) -> None:
        """A push failed: ``delta`` is older than anything recorded since, so it goes in front."""
        if self._delta is not None:
            delta.merge(self._delta)
        self._delta = delta if len(delta) else None

    def adopt(self, shared: Predictor) -> None:
        """Become ``shared`` plus the observations not pushed yet; keys the shared state lacks (past its
        cap) stay as learned here."""
        hists = dict(shared._hists)
        if self._delta is not None:  # observed while the script ran: newer than the shared state
            for level, hist in self._delta._hists.items():
                if level in hists:
                    hists[level].merge(hist)
        for level, hist in self._hists.items():  # local-only keys already hold every observation
            hists.setdefault(level, hist)
        self._hists = hists


class PredictorShare:
    """Periodic push-and-pull of a :class:`SharedPredictor` through one Redis hash."""

    def __init__(
        self,
        client: aioredis.Redis,
        predictor: SharedPredictor,
        *,
        namespace: str = "default",
        max_keys: int = DEFAULT_SHARED_MAX_KEYS,
    ) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self._client = client
        self.predictor = predictor
        self.key = f"kvr:{{{namespace}}}:pred"
        self.max_keys = max_keys
        self._script = client.register_script(PUSH_PULL_LUA)
        self.syncs = 0
        self.failures = 0

    @classmethod
    def from_url(
        cls, url: str, predictor: SharedPredictor, *, namespace: str = "default", timeout_s: float = 1.0
    ) -> PredictorShare:
        client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
        return cls(client, predictor, namespace=namespace)

    async def sync(self) -> int:
        """One exchange: push the delta, adopt the shared state. Returns the shared key count; raises
        RedisError/OSError/TimeoutError/ValueError (the delta is kept for the next try)."""
        p = self.predictor
        delta = p.take_delta()
        args: list[str | float | int] = [p.config.half_life_obs, self.max_keys, GLOBAL_LEVEL]
        for level, bins in delta.to_dict()["keys"].items():
            args += [level, encode_histogram(bins)]
        try:
            raw = await self._script(keys=[self.key], args=args)
            shared = self._decode(raw, p.config)
        except BaseException:
            p.put_back(delta)
            raise
        p.adopt(shared)
        self.syncs += 1
        return len(shared)

    @staticmethod
    def _decode(raw: Sequence[Any], config: PredictorConfig) -> Predictor:
        if len(raw) % 2:
            raise ValueError("shared predictor state: odd HGETALL reply")
        keys = {str(raw[i]): decode_histogram(str(raw[i + 1])) for i in range(0, len(raw), 2)}
        for bins in keys.values():
            if not all(math.isfinite(c) for c in bins.values()):
                raise ValueError("shared predictor state: non-finite count")
        return Predictor.from_dict({"version": 1, "keys": keys}, config)

    async def run(self, interval_s: float) -> None:
        """Sync now and every ``interval_s`` until cancelled; failures are logged and skipped."""
        failing = False
        while True:
            try:
                await self.sync()
                if failing:
                    log.info("predictor sharing through Redis works again")
                failing = False
            except (RedisError, OSError, TimeoutError, ValueError) as exc:
                self.failures += 1
                level = logging.DEBUG if failing else logging.WARNING
                log.log(level, "predictor sync failed (local predictor kept): %s", exc)
                failing = True
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        await self._client.aclose()
