"""The file behind the shared-memory ledger: its layout, creation, opening and the cross-process lock.

One file (on tmpfs: /dev/shm when it exists) mapped by every worker process of one ``kvrouter serve``.
Everything in it is an int64 word, read and written through one ``memoryview`` cast to ``q`` (tens of ns
per access, no struct packing), plus a byte area for rank names:

* header: magic, version, table sizes, how many rank keys are registered;
* the key table: per key index, its capacity, rank number and backend name (append-only: an index never
  changes, so every process may cache ``RankKey -> index``);
* per key, the totals (reserved tokens, in-flight count, generated tokens) that ``reserve`` compares with
  the capacity: one read per candidate, whatever the number of workers;
* per worker slot: pid, owner token, heartbeat (``time.monotonic_ns``, the same clock in every process
  on Linux), and the slot's own share of each key's totals. A dead worker's slot is zeroed and the totals
  recomputed from the live slots, which is what makes a crash mid-update harmless (see shm.py).

Mutual exclusion is ``flock`` on the file descriptor: the kernel blocks a waiter (no polling) and drops a
dead holder's lock. ``flock`` (not ``lockf``) because its locks belong to the open file description, so
two ledgers opened in one process exclude each other too, and closing one descriptor cannot drop another's.
"""

from __future__ import annotations

import mmap
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

MAGIC: Final[int] = 0x4B56_5254_4C45_4447  # "KVRTLEDG"
VERSION: Final[int] = 1
HEADER_WORDS: Final[int] = 8
H_MAGIC, H_VERSION, H_MAX_KEYS, H_MAX_SLOTS, H_KEYS, H_NAME_BYTES = range(6)
DEFAULT_MAX_KEYS: Final[int] = 256  # ranks over all backends
DEFAULT_MAX_SLOTS: Final[int] = 64  # worker processes alive at once (uvicorn restarts count until reaped)
DEFAULT_NAME_BYTES: Final[int] = 64  # a backend name, UTF-8
WORD_BYTES: Final[int] = 8
SHM_DIR: Final[Path] = Path("/dev/shm")
FILE_PREFIX: Final[str] = "kvrouter-ledger-"  # + the creating serve's pid + a random suffix


@dataclass(frozen=True, slots=True)
class Layout:
    """Word offsets of each array (``*_at``) for one file's table sizes."""

    max_keys: int
    max_slots: int
    name_bytes: int

    @property
    def cap_at(self) -> int:
        return HEADER_WORDS

    @property
    def rank_at(self) -> int:
        return self.cap_at + self.max_keys

    @property
    def name_len_at(self) -> int:
        return self.rank_at + self.max_keys

    @property
    def reserved_at(self) -> int:
        return self.name_len_at + self.max_keys

    @property
    def inflight_at(self) -> int:
        return self.reserved_at + self.max_keys

    @property
    def generated_at(self) -> int:
        return self.inflight_at + self.max_keys

    @property
    def pid_at(self) -> int:
        return self.generated_at + self.max_keys

    @property
    def token_at(self) -> int:
        return self.pid_at + self.max_slots

    @property
    def beat_at(self) -> int:
        return self.token_at + self.max_slots

    @property
    def slot_reserved_at(self) -> int:
        """Row ``slot * max_keys + key`` of the slots' reserved tokens (then in-flight, then generated)."""
        return self.beat_at + self.max_slots

    @property
    def slot_inflight_at(self) -> int:
        return self.slot_reserved_at + self.max_slots * self.max_keys

    @property
    def slot_generated_at(self) -> int:
        return self.slot_inflight_at + self.max_slots * self.max_keys

    @property
    def names_byte_at(self) -> int:
        return (self.slot_generated_at + self.max_slots * self.max_keys) * WORD_BYTES

    @property
    def size_bytes(self) -> int:
        return self.names_byte_at + self.max_keys * self.name_bytes


def default_dir() -> Path:
    """tmpfs when there is one (the file never touches a disk), else the system temp dir."""
    if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK):
        return SHM_DIR
    return Path(tempfile.gettempdir())


def create_ledger_file(
    path: str | None = None,
    *,
    max_keys: int = DEFAULT_MAX_KEYS,
    max_slots: int = DEFAULT_MAX_SLOTS,
    name_bytes: int = DEFAULT_NAME_BYTES,
) -> str:
    """Create (or truncate: a new serve never inherits an old ledger) an empty ledger file; returns its path.

    Without ``path``, a new uniquely named file in :func:`default_dir`. Raises ValueError on bad sizes.
    """
    if max_keys < 1 or max_slots < 1 or name_bytes < WORD_BYTES or name_bytes % WORD_BYTES:
        raise ValueError(f"bad ledger sizes: keys {max_keys}, slots {max_slots}, name bytes {name_bytes}")
    if path is None:
        remove_orphans(default_dir())
        path = str(default_dir() / f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
    layout = Layout(max_keys, max_slots, name_bytes)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, layout.size_bytes)  # zero-filled: every count starts at 0, every slot free
        with mmap.mmap(fd, layout.size_bytes) as mm:
            words = memoryview(mm).cast("q")
            words[H_VERSION] = VERSION
            words[H_MAX_KEYS], words[H_MAX_SLOTS], words[H_NAME_BYTES] = max_keys, max_slots, name_bytes
            words[H_MAGIC] = MAGIC  # last: an opener never accepts a half-written header
            words.release()
    finally:
        os.close(fd)
    return path


def remove_ledger_file(path: str) -> None:
    Path(path).unlink(missing_ok=True)


def remove_orphans(directory: Path) -> None:
    """Remove default-named files whose serve is gone (it was killed before it could remove its own)."""
    for stale in directory.glob(f"{FILE_PREFIX}*"):
        pid = stale.name.removeprefix(FILE_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            stale.unlink(missing_ok=True)  # a worker still mapping it keeps its pages: nothing breaks


def pid_alive(pid: int) -> bool:
    """A zombie (killed, not yet reaped by its parent) counts as dead: it will never call again."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0), the heartbeat catches the rest
    return stat.rpartition(")")[2].split()[0] != "Z"


class LedgerFile:
    """One process's mapping of a ledger file: ``words`` (int64) and ``names`` (bytes) over the same pages."""

    def __init__(self, path: str) -> None:
        try:
            self.fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ValueError(
                f"shared-memory ledger file {path} does not exist (the serving parent creates it)"
            ) from None
        try:
            size_bytes = os.fstat(self.fd).st_size
            if size_bytes < HEADER_WORDS * WORD_BYTES:
                raise ValueError(f"{path} is not a kvrouter ledger file (too short)")
            self._mm = mmap.mmap(self.fd, size_bytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.words = memoryview(self._mm).cast("q")
        self.names = memoryview(self._mm)
        w = self.words
        if w[H_MAGIC] != MAGIC or w[H_VERSION] != VERSION:
            self.close()
            raise ValueError(f"{path} is not a kvrouter ledger file of version {VERSION}")
        self.layout = Layout(w[H_MAX_KEYS], w[H_MAX_SLOTS], w[H_NAME_BYTES])
        if self.layout.size_bytes != size_bytes:
            self.close()
            raise ValueError(f"{path}: size {size_bytes} B does not match its header")

    def keys(self) -> int:
        """How many rank keys the table holds."""
        return int(self.words[H_KEYS])

    def dead_slots(self, stale_ns: int, keep: int) -> list[int]:
        """Slots other than ``keep`` whose worker is gone or last beat before ``stale_ns``."""
        w, lay = self.words, self.layout
        return [
            s
            for s in range(lay.max_slots)
            if s != keep
            and (pid := w[lay.pid_at + s]) != 0
            and (w[lay.beat_at + s] < stale_ns or not pid_alive(pid))
        ]

    def zero_slot(self, slot: int) -> None:
        """Free a slot and clear its shares (the totals are the caller's: see :meth:`recount`)."""
        w, lay, row = self.words, self.layout, slot * self.layout.max_keys
        for k in range(self.keys()):
            w[lay.slot_reserved_at + row + k] = 0
            w[lay.slot_inflight_at + row + k] = 0
            w[lay.slot_generated_at + row + k] = 0
        w[lay.pid_at + slot] = 0
        w[lay.token_at + slot] = 0

    def recount(self) -> None:
        """Set every total to the sum of the live slots' shares (repairs a total a dying process left)."""
        w, lay, mk = self.words, self.layout, self.layout.max_keys
        live = [s for s in range(lay.max_slots) if w[lay.pid_at + s] != 0]
        pairs = (
            (lay.reserved_at, lay.slot_reserved_at),
            (lay.inflight_at, lay.slot_inflight_at),
            (lay.generated_at, lay.slot_generated_at),
        )
        for k in range(self.keys()):
            for total_at, share_at in pairs:
                w[total_at + k] = sum(w[share_at + s * mk + k] for s in live)

    def reserved_per_pid(self) -> dict[int, int]:
        w, lay, mk = self.words, self.layout, self.layout.max_keys
        return {
            w[lay.pid_at + s]: sum(w[lay.slot_reserved_at + s * mk + k] for k in range(self.keys()))
            for s in range(lay.max_slots)
            if w[lay.pid_at + s] != 0
        }

    def read_name(self, index: int) -> str:
        at = self.layout.names_byte_at + index * self.layout.name_bytes
        length = self.words[self.layout.name_len_at + index]
        return bytes(self.names[at : at + length]).decode()

    def write_name(self, index: int, encoded: bytes) -> None:
        at = self.layout.names_byte_at + index * self.layout.name_bytes
        self.names[at : at + len(encoded)] = encoded
        self.words[self.layout.name_len_at + index] = len(encoded)

    def close(self) -> None:
        self.words.release()
        self.names.release()
        self._mm.close()
        os.close(self.fd)
