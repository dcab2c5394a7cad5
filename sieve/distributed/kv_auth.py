"""Who may move KV between engines: one shared secret, three keys derived from it.

Prefill and decode servers (and nothing else) hold the secret (`kv_transfer_config.secret_file`). From it:
- params key: a prefill server signs the `kv_transfer_params` it answers with (HMAC-SHA256 over the params, a nonce
  and an expiry); a decode server takes remote-prefill params only with a valid signature, before the expiry, once.
  A client cannot make a decode server connect anywhere or read anything: the address is inside what was signed.
- block key: every block carries a MAC over its bytes and the token ids it holds (which are not sent), checked before
  anything touches the prefix cache. A block from a peer without the secret, or for other tokens, is refused.
- port key: the producer's KV port answers only a client that signs the producer's fresh challenge.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import threading
import time
from array import array
from pathlib import Path

MIN_SECRET_BYTES = 16
MAC_BYTES = 32


class KVParamsError(ValueError):
    """kv_transfer_params that must not be acted on (unsigned, forged, expired, replayed, an unlisted producer)."""


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def tokens_bytes(token_ids: list[int]) -> bytes:
    return array("q", token_ids).tobytes()


class KVAuth:
    def __init__(self, secret: bytes, params_ttl_s: float):
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the KV transfer secret is {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES}")
        derive = lambda label: hmac.new(secret, label, hashlib.sha256).digest()  # noqa: E731
        self._params_key, self._block_key, self._port_key = derive(b"sieve-kv params"), derive(b"sieve-kv block"), derive(b"sieve-kv port")
        self.params_ttl_s = params_ttl_s
        self._seen: dict[str, float] = {}  # nonces of params already taken, until they expire
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str, params_ttl_s: float) -> "KVAuth":
        p = Path(path)
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(f"{path} can be read by other users (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
        return cls(p.read_bytes().strip(), params_ttl_s)

    # ---- params ----------------------------------------------------------------------------
    def sign(self, params: dict) -> dict:
        body = dict(params, kv_nonce=secrets.token_hex(16), kv_expires=round(time.time() + self.params_ttl_s, 3))
        return dict(body, kv_signature=hmac.new(self._params_key, _canonical(body), hashlib.sha256).hexdigest())

    def check(self, params: dict) -> dict:
        """The params' signature, expiry and freshness; returns them without the signature fields."""
        body = {k: v for k, v in params.items() if k != "kv_signature"}
        sig = params.get("kv_signature")
        if not isinstance(sig, str):
            raise KVParamsError("kv_transfer_params are not signed: only a prefill server holding this server's secret "
                                "issues remote-prefill params")
        try:
            blob = _canonical(body)
        except (TypeError, ValueError):
            raise KVParamsError("kv_transfer_params are not plain JSON") from None
        if not hmac.compare_digest(hmac.new(self._params_key, blob, hashlib.sha256).hexdigest(), sig):
            raise KVParamsError("kv_transfer_params' signature does not verify")
        expires, nonce = body.get("kv_expires"), body.get("kv_nonce")
        if not isinstance(expires, (int, float)) or expires < time.time():
            raise KVParamsError("kv_transfer_params have expired")
        now = time.time()
        with self._lock:
            for n in [n for n, t in self._seen.items() if t < now]:
                del self._seen[n]
            if nonce in self._seen:
                raise KVParamsError("kv_transfer_params were used already")
            self._seen[nonce] = float(expires)
        return body

    # ---- blocks ----------------------------------------------------------------------------
    def block_mac(self, body: bytes, token_ids: list[int]) -> bytes:
        return hmac.new(self._block_key, body + tokens_bytes(token_ids), hashlib.sha256).digest()

    def block_ok(self, body: bytes, token_ids: list[int], mac: bytes) -> bool:
        return hmac.compare_digest(self.block_mac(body, token_ids), mac)

    # ---- the KV port -------------------------------------------------------------------------
    @staticmethod
    def challenge() -> bytes:
        return secrets.token_hex(16).encode()

    def answer(self, challenge: bytes, request: dict) -> str:
        return hmac.new(self._port_key, challenge + b"|" + _canonical(request), hashlib.sha256).hexdigest()

    def answer_ok(self, challenge: bytes, request: dict, mac) -> bool:
        return isinstance(mac, str) and hmac.compare_digest(self.answer(challenge, request), mac)


def private_dir(path: str | None) -> Path:
    """A shared-memory directory only this user can enter, made fresh (an existing one is refused: another user could
    have made it, or left files in it)."""
    p = Path(path) if path else Path("/dev/shm") / f"sieve-kv-{secrets.token_hex(8)}"
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        raise ValueError(f"{p} exists already: the KV directory must be new (give another shm_dir)") from None
    os.chmod(p, 0o700)  # whatever the umask
    return p


def check_private_dir(path: Path) -> None:
    """A producer's directory as a consumer finds it: a real directory of this user's, closed to everyone else."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{path} is not a directory")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(f"{path} is not private to this user")
