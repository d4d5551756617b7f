"""Writes of the Placement Controller (spec 6.3-6.5)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from kvsp.hexids import is_hex
from kvsp.problems import ProtocolError
from placement.models import Instance

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")


def check_instance_name(name: str) -> str:
    """Instance names become queue names (``ii.<name>``): lowercase, digits, '.', '_', '-'."""
    if not _NAME.fullmatch(name):
        raise ProtocolError(
            "kvsp-malformed-request",
            f"instance name {name!r}: use 1-100 of a-z, 0-9, '.', '_', '-', starting alnum",
        )
    return name


def check_base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or not url.endswith("/"):
        raise ProtocolError(
            "kvsp-malformed-request", f"{url!r} is not an http(s) base URL ending with '/'"
        )
    return url


def do_register_instance(name: str, url: str, *, compat_ids=()) -> Instance:
    check_instance_name(name)
    check_base_url(url)
    for compat_id in compat_ids:
        if not is_hex(compat_id, 32):
            raise ProtocolError("kvsp-malformed-request", f"{compat_id!r} is not a hex32 id")
    if Instance.objects.filter(name=name).exists():
        raise ProtocolError("kvsp-conflict", f"an instance named {name!r} exists already")
    if Instance.objects.filter(url=url).exists():
        raise ProtocolError("kvsp-conflict", f"an instance with URL {url} exists already")
    return Instance.objects.create(name=name, url=url, compat_ids=list(compat_ids))
