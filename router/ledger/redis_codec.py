"""How ranks and usage rows are spelled inside Redis (hash fields, Lua arguments and replies)."""

from __future__ import annotations

from collections.abc import Mapping

from router.ledger.base import RankUsage
from router.placement.snapshot import RankKey


class FieldCodec:
    """``RankKey`` <-> hash field ``"{rank}:{backend}"``, memoised both ways (hot path: every reserve)."""

    def __init__(self) -> None:
        self._fields: dict[RankKey, str] = {}
        self._keys_by_field: dict[str, RankKey] = {}

    def field(self, key: RankKey) -> str:
        field = self._fields.get(key)
        if field is None:
            field = self._fields[key] = f"{key.rank}:{key.backend}"
            self._keys_by_field[field] = key
        return field

    def key(self, field: str) -> RankKey:
        key = self._keys_by_field.get(field)
        if key is None:
            rank, backend = field.split(":", 1)
            key = self._keys_by_field[field] = RankKey(backend, int(rank))
        return key

    def cap_args(self, caps: Mapping[RankKey, int]) -> list[str | int]:
        """Lua arguments: the count, then field and capacity pairs."""
        args: list[str | int] = [len(caps)]
        for key, capacity_tokens in caps.items():
            args += [self.field(key), capacity_tokens]
        return args

    def parse_usage(self, raw: str) -> dict[RankKey, RankUsage]:
        """The USAGE script's reply: rows split by RS (0x1e), columns by US (0x1f)."""
        usage: dict[RankKey, RankUsage] = {}
        for row in raw.split("\x1e") if raw else ():
            cap, res, inf, gen, field = row.split("\x1f", 4)
            usage[self.key(field)] = RankUsage(int(cap), int(res), int(inf), int(gen))
        return usage
