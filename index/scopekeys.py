"""Scope keys at rest (DESIGN.md section 6): AES-GCM under KVSP_MASTER_KEY.

The scope id is the associated data, so a ciphertext moved to another scope's row fails to open.
"""

from __future__ import annotations

import os

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from django.conf import settings

_NONCE_OCTETS = 12


def seal_scope_key(scope_id: bytes, scope_key: bytes) -> bytes:
    nonce = os.urandom(_NONCE_OCTETS)
    return nonce + AESGCM(settings.KVSP_MASTER_KEY).encrypt(nonce, scope_key, scope_id)


def open_scope_key(scope_id: bytes, sealed: bytes) -> bytes:
    sealed = bytes(sealed)
    nonce, ciphertext = sealed[:_NONCE_OCTETS], sealed[_NONCE_OCTETS:]
    return AESGCM(settings.KVSP_MASTER_KEY).decrypt(nonce, ciphertext, bytes(scope_id))
