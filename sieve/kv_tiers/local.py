"""What the tiers that keep their own index in this process (host RAM, local disk) answer alike."""

from __future__ import annotations


class LocalIndex:
    """A store with a local index: `has(key)` as cheap as asking, and `read(key)` one block's payload or None."""

    def knows(self, key: str) -> bool:
        return self.has(key)

    def leading(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, the tier holds."""
        n = 0
        while n < len(keys) and self.has(keys[n]):
            n += 1
        return n

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        return [self.read(k) for k in keys]
