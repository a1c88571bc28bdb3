"""mpsd's logging: the one line format of every command (``LOG_FORMAT``), and a warning said once
per key (``OncePerKey``: a region path, an error text), remembering a bounded number of keys.

The usage readers warn once per unreadable region: with a plain set, every path that ever
warned stayed in memory for the daemon's life, one more per pod that came and went. Here the
least recently seen key is forgotten past ``limit``: memory is bounded, and a key forgotten
that fails again is warned about again (at most once per ``limit`` other keys in between).
"""

from __future__ import annotations

from collections import OrderedDict

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class OncePerKey:
    LIMIT = 1024

    def __init__(self, limit: int = LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"bad limit {limit!r}: expected at least 1 key")
        self.limit = limit
        self._keys: OrderedDict[str, None] = OrderedDict()

    def first(self, key: str) -> bool:
        """True if ``key`` is not remembered (warn now); it is remembered from now on."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return False
        self._keys[key] = None
        if len(self._keys) > self.limit:
            self._keys.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys
