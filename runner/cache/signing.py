"""Signing artifacts: HMAC-SHA256 with a secret from the user's config, Ed25519 when `cryptography` exists.

Key sources, first found wins: env DFLASH_CACHE_SIGNING_KEY (an HMAC secret), then
`~/.config/dflashctl/config.toml` (respecting XDG_CONFIG_HOME):

    [cache]
    signing_key = "a long random secret shared by the hosts you trust"   # HMAC-SHA256
    ed25519_private_key = "~/.config/dflashctl/cache_ed25519.pem"       # sign (needs cryptography)
    ed25519_public_keys = ["~/.config/dflashctl/team_ed25519.pub.pem"]   # verify (needs cryptography)

A signature covers the canonical manifest without its signature field; the manifest in turn pins
the archive's sha256 and every file's sha256, so one signature covers every byte that is restored.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.cache.manifest import Manifest, Signature
from runner.cache.settings import cache_table, config_path
from runner.errors import BadInput, RunnerError

__all__ = ["Keyring", "check_signature", "config_path", "load_keyring", "sign"]

HMAC_ALG = "hmac-sha256"
ED25519_ALG = "ed25519"
MIN_SECRET_BYTES = 16


@dataclass(kw_only=True, slots=True)
class Keyring:
    """The keys this user signs with and trusts."""

    hmac_secret: bytes | None = None
    ed25519_private_pem: bytes | None = None
    ed25519_public_pems: list[bytes] = field(default_factory=list)

    @property
    def can_sign(self) -> bool:
        return self.hmac_secret is not None or self.ed25519_private_pem is not None


def hmac_key_id(secret: bytes) -> str:
    # Names the key without revealing it, so a mismatch can say which key signed.
    return "hmac:" + hashlib.sha256(b"dflashctl-key-id\0" + secret).hexdigest()[:16]


def _crypto() -> Any:
    try:
        return importlib.import_module("cryptography.hazmat.primitives.serialization")
    except ImportError:
        raise RunnerError(
            "Ed25519 keys are configured but the `cryptography` package is not installed; "
            "install it or use [cache] signing_key (HMAC)"
        ) from None


def load_keyring(path: Path | None = None) -> Keyring:
    ring = Keyring()
    cfg_file = path or config_path()
    section = cache_table(cfg_file)
    secret = os.environ.get("DFLASH_CACHE_SIGNING_KEY") or section.get("signing_key")
    if secret:
        if not isinstance(secret, str) or len(secret.encode()) < MIN_SECRET_BYTES:
            raise BadInput(
                f"the cache signing key must be a string of at least {MIN_SECRET_BYTES} bytes "
                f"(env DFLASH_CACHE_SIGNING_KEY or [cache] signing_key in {cfg_file})"
            )
        ring.hmac_secret = secret.encode()

    def pem(key: str, value: object) -> bytes:
        path = Path(str(value)).expanduser()
        try:
            return path.read_bytes()
        except OSError as e:
            raise BadInput(
                f"[cache] {key} in {cfg_file}: cannot read {path}: {e.strerror}; fix the path there"
            ) from None

    if section.get("ed25519_private_key"):
        ring.ed25519_private_pem = pem("ed25519_private_key", section["ed25519_private_key"])
    publics = section.get("ed25519_public_keys", [])
    if not isinstance(publics, list):
        raise BadInput(
            f'[cache] ed25519_public_keys in {cfg_file}: use a list of PEM paths, e.g. ["~/team.pem"]'
        )
    for pub in publics:
        ring.ed25519_public_pems.append(pem("ed25519_public_keys", pub))
    return ring


def _ed25519_key_id(public_raw: bytes) -> str:
    return "ed25519:" + hashlib.sha256(public_raw).hexdigest()[:16]


def _ed25519_public(pem: bytes) -> Any:
    ser = _crypto()
    return ser.load_pem_public_key(pem)


def _raw_public(pub: Any) -> bytes:
    ser = _crypto()
    return bytes(pub.public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw))


def sign(manifest: Manifest, ring: Keyring) -> Signature:
    """Sign with Ed25519 when a private key is configured, else HMAC."""
    payload = manifest.signing_payload()
    if ring.ed25519_private_pem is not None:
        try:
            priv = _crypto().load_pem_private_key(ring.ed25519_private_pem, password=None)
        except (ValueError, TypeError) as e:
            raise BadInput(
                f"[cache] ed25519_private_key in {config_path()} is not an unencrypted PEM private key ({e})"
            ) from None
        value = base64.b64encode(priv.sign(payload)).decode()
        return Signature(alg=ED25519_ALG, key_id=_ed25519_key_id(_raw_public(priv.public_key())), value=value)
    if ring.hmac_secret is not None:
        value = hmac.new(ring.hmac_secret, payload, hashlib.sha256).hexdigest()
        return Signature(alg=HMAC_ALG, key_id=hmac_key_id(ring.hmac_secret), value=value)
    raise RunnerError(
        f"no signing key configured: set DFLASH_CACHE_SIGNING_KEY or [cache] signing_key in {config_path()}"
    )


def check_signature(manifest: Manifest, ring: Keyring) -> tuple[str, str]:
    """(status, detail) with status one of unsigned | valid | invalid | unverifiable."""
    sig = manifest.signature
    if sig is None:
        return "unsigned", "the artifact carries no signature"
    payload = manifest.signing_payload()
    if sig.alg == HMAC_ALG:
        if ring.hmac_secret is None:
            return "unverifiable", f"signed with {sig.key_id}, but no HMAC signing key is configured here"
        want = hmac.new(ring.hmac_secret, payload, hashlib.sha256).hexdigest()
        if hmac.compare_digest(want.encode(), sig.value.encode()):
            return "valid", f"HMAC-SHA256 with {sig.key_id}"
        mine = hmac_key_id(ring.hmac_secret)
        why = (
            "the manifest was changed after signing"
            if mine == sig.key_id
            else f"signed with {sig.key_id}, your key is {mine}"
        )
        return "invalid", f"HMAC-SHA256 signature does not verify ({why})"
    if sig.alg == ED25519_ALG:
        if not ring.ed25519_public_pems:
            return "unverifiable", f"signed with {sig.key_id}, but no Ed25519 public keys are configured"
        try:
            raw_sig = base64.b64decode(sig.value, validate=True)
        except ValueError:
            return "invalid", "Ed25519 signature is not base64"
        for pem in ring.ed25519_public_pems:
            try:
                pub = _ed25519_public(pem)
            except (ValueError, TypeError) as e:
                raise BadInput(
                    f"[cache] ed25519_public_keys in {config_path()}: a key is not a PEM public key ({e})"
                ) from None
            if _ed25519_key_id(_raw_public(pub)) != sig.key_id:
                continue
            try:
                pub.verify(raw_sig, payload)
                return "valid", f"Ed25519 with {sig.key_id}"
            except Exception:  # cryptography raises InvalidSignature; any failure means not valid
                return (
                    "invalid",
                    f"Ed25519 signature by {sig.key_id} does not verify (manifest changed after signing)",
                )
        return "unverifiable", f"signed with {sig.key_id}, which is not among your trusted Ed25519 keys"
    return "invalid", f"unknown signature algorithm {sig.alg!r}"
