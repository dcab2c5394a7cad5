"""API keys, and the tenant each one belongs to: what the server and the gateway check on every protected route.

A key is given on the command line (`--api-key`, repeatable) or in a file (`--api-keys-file`: a line per key,
`TENANT:KEY` or a bare `KEY`, whose tenant is then named after its hash; `#` starts a comment). Every key is compared
in constant time, and all of them on every request, so the time taken tells nothing about any key.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path


class APIKeys:
    def __init__(self, keys: dict[str, str] | None = None, hashed: dict[str, str] | None = None):
        """`keys`: key -> tenant; `hashed`: a key's sha256 (hex) -> tenant (a file that holds no secret)."""
        self.by_key = dict(keys or {})
        self._keys = [(f"Bearer {k}".encode(), t) for k, t in self.by_key.items()]
        self._hashed = [(bytes.fromhex(h), t) for h, t in (hashed or {}).items()]

    @classmethod
    def load(cls, keys: list[str] | None = None, path: str | None = None) -> "APIKeys":
        table = {k: default_tenant(k) for k in keys or [] if k}
        if path:
            try:
                lines = Path(path).read_text().splitlines()
            except OSError as e:
                raise ValueError(f"cannot read the API keys file {path}: {e}") from None
            for n, line in enumerate(lines, 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                tenant, sep, key = line.partition(":")
                if not sep:
                    tenant, key = default_tenant(line), line
                if not key.strip() or not tenant.strip():
                    raise ValueError(f"{path}:{n}: expected TENANT:KEY or KEY")
                table[key.strip()] = tenant.strip()
        return cls(table)

    @property
    def enabled(self) -> bool:
        return bool(self._keys or self._hashed)

    @property
    def num_tenants(self) -> int:
        return len({t for _, t in self._keys + self._hashed})

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of the key in an Authorization header value, or None (no key, or a wrong one)."""
        given = (authorization or "").encode()
        found = None
        for expected, tenant in self._keys:  # every key, every time: no early exit
            if hmac.compare_digest(expected, given):
                found = tenant
        if self._hashed:
            scheme, _, key = given.partition(b" ")
            digest = hashlib.sha256(key).digest() if scheme == b"Bearer" else b""
            for expected, tenant in self._hashed:
                if hmac.compare_digest(expected, digest):
                    found = tenant
        return found


def default_tenant(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]
