"""Tenants and their API keys (the management side of Y.2501's orchestration layer).

A key is `cpn_` + 43 URL-safe characters (256 random bits). Only its SHA-256 digest is
stored; its first 12 characters (`prefix`) name it in lists and revocations. A request
authenticates with `Authorization: Bearer <key>`; `authenticate()` turns the key into
the tenant and role it acts as, or refuses it (unknown, revoked).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from cpn.orchestration.errors import InvalidRequest, NotFound, Unauthorized
from cpn.registry.models import ApiKey, Role, Tenant, utcnow

KEY_PREFIX = "cpn_"
PREFIX_CHARS = 12
MAX_KEY_LENGTH = 256


@dataclass(frozen=True)
class Principal:
    """Who a request acts for."""

    tenant_id: int
    tenant: str
    role: Role

    @property
    def admin(self) -> bool:
        return self.role is Role.ADMIN


@dataclass(frozen=True)
class NewKey:
    key: str  # shown once; never stored
    prefix: str
    tenant: str
    role: Role


def digest(key: str) -> str:
    """What is stored of a key. A plain, fast SHA-256 on purpose: a key is 256 random
    bits, so nobody can guess one from its digest however fast the hash, and a slow
    password hash (bcrypt, scrypt, argon2: tens of ms of CPU by design) would only cap
    every authenticated request at a few dozen per second per core. Slow hashes protect
    low-entropy secrets that people choose; these are not. (A keyed HMAC would add
    nothing either, and would need a server secret shared by every control plane.)"""
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(
    session: Session, tenant: str, *, role: Role = Role.USER, gpu_quota: int | None = None
) -> NewKey:
    """A new key for `tenant` (made if new); `gpu_quota` sets the tenant's quota if given."""
    if not tenant or len(tenant) > 64 or not tenant.replace("-", "").replace("_", "").isalnum():
        raise InvalidRequest(f"--tenant: {tenant!r}: 1–64 letters, digits, - and _")
    if gpu_quota is not None and gpu_quota < 0:
        raise InvalidRequest(f"--gpu-quota: {gpu_quota} must be ≥ 0")
    row = session.scalar(select(Tenant).where(Tenant.name == tenant).with_for_update())
    if row is None:
        row = Tenant(name=tenant, gpu_quota=gpu_quota)
        session.add(row)
        session.flush()
    elif gpu_quota is not None:
        row.gpu_quota = gpu_quota
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    prefix = key[:PREFIX_CHARS]
    session.add(ApiKey(key_hash=digest(key), prefix=prefix, tenant_id=row.id, role=role))
    session.flush()
    return NewKey(key=key, prefix=prefix, tenant=tenant, role=role)


def revoke_key(session: Session, key_or_prefix: str) -> ApiKey:
    """Revoke a key given whole or by its prefix. Revoking twice is not an error."""
    by = ApiKey.key_hash == digest(key_or_prefix)
    if len(key_or_prefix) <= PREFIX_CHARS:
        by = ApiKey.prefix == key_or_prefix
    row = session.scalar(select(ApiKey).where(by))
    if row is None:
        raise NotFound(f"key {key_or_prefix[:PREFIX_CHARS]!r}: no such key")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    return row


def check_form(key: str | None) -> str:
    """The key if it looks like a cpn API key (refused before any lookup otherwise)."""
    if not key:
        raise Unauthorized("Authorization: missing (send 'Authorization: Bearer <API key>')")
    if len(key) > MAX_KEY_LENGTH or not key.startswith(KEY_PREFIX):
        raise Unauthorized("Authorization: not a cpn API key")
    return key


def authenticate(session: Session, key: str | None) -> Principal:
    key = check_form(key)
    row = session.execute(
        select(ApiKey.revoked_at, ApiKey.role, Tenant.id, Tenant.name)
        .join(Tenant, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == digest(key))
    ).first()
    if row is None:
        raise Unauthorized("Authorization: unknown API key")
    revoked_at, role, tenant_id, tenant = row
    if revoked_at is not None:
        raise Unauthorized("Authorization: this API key was revoked")
    return Principal(tenant_id=tenant_id, tenant=tenant, role=role)


class KeyCache:
    """Principals of API keys seen in the last `ttl_s` seconds, so that a burst of
    requests with one key costs one lookup, not one each.

    The price is a bound on revocation: a revoked key keeps working for at most `ttl_s`
    after `cpn keys revoke` commits (revocation is a database write, possibly from another
    process, so nothing can tell this cache at once). Only accepted keys are kept —
    an unknown or revoked key is looked up every time, so a key created a moment ago
    works at once and refusals cannot fill the cache — and at most `size` of them.
    `ttl_s = 0` turns the cache off.
    """

    def __init__(self, ttl_s: float, size: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.size = size
        self._entries: OrderedDict[str, tuple[float, Principal]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Principal | None:
        if self.ttl_s <= 0:
            return None
        name = digest(key)
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return None
            if time.monotonic() >= entry[0]:
                del self._entries[name]
                return None
            return entry[1]

    def put(self, key: str, principal: Principal) -> None:
        if self.ttl_s <= 0:
            return
        name = digest(key)
        with self._lock:
            self._entries[name] = (time.monotonic() + self.ttl_s, principal)
            self._entries.move_to_end(name)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)


def list_keys(session: Session) -> list[tuple[ApiKey, Tenant]]:
    rows = session.execute(
        select(ApiKey, Tenant).join(Tenant, ApiKey.tenant_id == Tenant.id).order_by(ApiKey.id)
    )
    return [(k, t) for k, t in rows]
