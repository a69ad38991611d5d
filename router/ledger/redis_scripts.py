"""Lua scripts of the Redis ledger: each ledger operation is one script, so one round trip, atomic.

Keys (all under one hash tag ``kvr:{ns}:``, so a Redis Cluster keeps a deployment in one slot):
``cap`` HASH rank → capacity tokens; ``res``/``inf``/``gen`` HASH rank → reserved tokens / in-flight
requests / generated tokens; ``rec`` HASH request id → ``"tokens:generated:rank"``; ``lease`` ZSET
request id → lease expiry in ms of the *Redis server's* clock (``TIME``): replicas with skewed clocks agree.

A lease whose expiry is <= now is dead: every script that touches a request id reclaims it first if dead,
and ``reserve``/``usage`` reclaim a bounded batch of dead leases (oldest first, via the ZSET), so expiry
never needs a key scan and never depends on a replica calling ``expire``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

KEY_SUFFIXES: Final[tuple[str, ...]] = ("cap", "res", "inf", "gen", "rec", "lease")

_PRELUDE: Final[str] = """
local K_CAP, K_RES, K_INF, K_GEN, K_REC, K_LEASE = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function parse(v)
  local tokens, generated, field = string.match(v, '^(%d+):(%d+):(.*)$')
  return tonumber(tokens), tonumber(generated), field
end
local function incr(key, field, n)
  if n ~= 0 then redis.call('HINCRBY', key, field, string.format('%d', n)) end
end
local function record(tokens, generated, field)
  return string.format('%d:%d:%s', tokens, generated, field)
end
local function reclaim(id)
  redis.call('ZREM', K_LEASE, id)
  local v = redis.call('HGET', K_REC, id)
  if not v then return 0 end
  local tokens, generated, field = parse(v)
  incr(K_RES, field, -tokens)
  incr(K_INF, field, -1)
  incr(K_GEN, field, -generated)
  redis.call('HDEL', K_REC, id)
  return 1
end
local function expire_due(now, limit)
  local ids = redis.call('ZRANGEBYSCORE', K_LEASE, '-inf', now, 'LIMIT', 0, limit)
  for i = 1, #ids do reclaim(ids[i]) end
  return #ids
end
local function live(id, now)
  local score = redis.call('ZSCORE', K_LEASE, id)
  if not score then return false end
  if tonumber(score) <= now then reclaim(id) return false end
  return redis.call('HGET', K_REC, id)
end
"""

# ARGV: id, tokens, ttl_ms, expire_limit, rank field... → index of the rank reserved (0-based) or -1.
_RESERVE: Final[str] = """
local id, tokens, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
expire_due(now, tonumber(ARGV[4]))
if live(id, now) then return redis.error_reply('KVR_DUPLICATE ' .. id) end
local caps = {}
for i = 5, #ARGV do
  local c = redis.call('HGET', K_CAP, ARGV[i])
  if not c then return redis.error_reply('KVR_UNKNOWN_RANK ' .. ARGV[i]) end
  caps[i] = tonumber(c)
end
for i = 5, #ARGV do
  local f = ARGV[i]
  if tonumber(redis.call('HGET', K_RES, f) or '0') + tokens <= caps[i] then
    incr(K_RES, f, tokens)
    incr(K_INF, f, 1)
    redis.call('HSET', K_REC, id, record(tokens, 0, f))
    redis.call('ZADD', K_LEASE, now + ttl, id)
    return i - 5
  end
end
return -1
"""

# ARGV: id, op ('grow' | 'shrink' | 'gen'), tokens → 1 if applied, 0 if absent (or grow does not fit).
_ADJUST: Final[str] = """
local id, op, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local v = live(id, now_ms())
if not v then return 0 end
local tokens, generated, f = parse(v)
if op == 'grow' then
  local cap = tonumber(redis.call('HGET', K_CAP, f) or '0')
  if tonumber(redis.call('HGET', K_RES, f) or '0') + n > cap then return 0 end
  incr(K_RES, f, n)
  tokens = tokens + n
elseif op == 'shrink' then
  n = math.min(n, tokens)
  incr(K_RES, f, -n)
  tokens = tokens - n
else
  incr(K_GEN, f, n)
  generated = generated + n
end
redis.call('HSET', K_REC, id, record(tokens, generated, f))
return 1
"""

# ARGV: id... → how many of them were live and are now released (a dead lease counts as already gone).
_RELEASE: Final[str] = """
local now, n = now_ms(), 0
for i = 1, #ARGV do
  if live(ARGV[i], now) then n = n + reclaim(ARGV[i]) end
end
return n
"""

# ARGV: ttl_ms, n_renew, id × n_renew, id to release... → ids that were not live (lost or expired).
_RENEW: Final[str] = """
local now, ttl, n = now_ms(), tonumber(ARGV[1]), tonumber(ARGV[2])
local missing = {}
for i = 3, 2 + n do
  if live(ARGV[i], now) then
    redis.call('ZADD', K_LEASE, 'XX', now + ttl, ARGV[i])
  else
    missing[#missing + 1] = ARGV[i]
  end
end
for i = 3 + n, #ARGV do reclaim(ARGV[i]) end
return missing
"""

# ARGV: limit, id to release... → how many dead leases were reclaimed (at most limit).
_EXPIRE: Final[str] = """
local n = expire_due(now_ms(), tonumber(ARGV[1]))
for i = 2, #ARGV do reclaim(ARGV[i]) end
return n
"""

# ARGV: id → its record string, or nil.
_GET: Final[str] = """
local v = live(ARGV[1], now_ms())
if not v then return nil end
return v
"""

# ARGV: expire_limit → one string, a row per registered rank: "cap US res US inf US gen US rank" joined
# by RS (ASCII 31 / 30). One bulk string parses in one step client-side, unlike 4 × 2 × ranks replies.
_USAGE: Final[str] = """
expire_due(now_ms(), tonumber(ARGV[1]))
local cap = redis.call('HGETALL', K_CAP)
local rows = {}
for i = 1, #cap, 2 do
  local f = cap[i]
  rows[#rows + 1] = table.concat({cap[i + 1], redis.call('HGET', K_RES, f) or '0',
    redis.call('HGET', K_INF, f) or '0', redis.call('HGET', K_GEN, f) or '0', f}, '\\31')
end
return table.concat(rows, '\\30')
"""

# ARGV: ttl_ms, n_caps, (field, capacity) × n_caps, (id, field, tokens, generated)... → records adopted.
# Puts back what this replica knows is live but Redis lost (restart) or reclaimed (replica stalled past
# its TTL), and what it reserved locally while Redis was down: these requests run on the engine, so they
# are written even if a rank goes over capacity (new reserves then wait until it drains).
_RESYNC: Final[str] = """
local now, ttl, ncap = now_ms(), tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 3, 2 + 2 * ncap, 2 do redis.call('HSET', K_CAP, ARGV[i], ARGV[i + 1]) end
local adopted = 0
for i = 3 + 2 * ncap, #ARGV, 4 do
  local id, f, tokens, generated = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  if live(id, now) then
    redis.call('ZADD', K_LEASE, 'XX', now + ttl, id)
  else
    incr(K_RES, f, tokens)
    incr(K_INF, f, 1)
    incr(K_GEN, f, generated)
    redis.call('HSET', K_REC, id, record(tokens, generated, f))
    redis.call('ZADD', K_LEASE, now + ttl, id)
    adopted = adopted + 1
  end
end
return adopted
"""


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str
    sha: str


def _script(name: str, body: str) -> Script:
    source = _PRELUDE + body
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


RESERVE: Final[Script] = _script("reserve", _RESERVE)
ADJUST: Final[Script] = _script("adjust", _ADJUST)
RELEASE: Final[Script] = _script("release", _RELEASE)
RENEW: Final[Script] = _script("renew", _RENEW)
EXPIRE: Final[Script] = _script("expire", _EXPIRE)
GET: Final[Script] = _script("get", _GET)
USAGE: Final[Script] = _script("usage", _USAGE)
RESYNC: Final[Script] = _script("resync", _RESYNC)
