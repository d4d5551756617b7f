"""Who may publish what in the Index Service (spec 6.1; DESIGN.md section 6).

A principal publishes into a scope it is granted, for the holder URLs it lists or for the URL of
the instance it is bound to, and is told about another scope's data exactly what it would be
told if the data did not exist. Who reads a scope is ``common.permissions.may_read_scope``, the
same rule on every app and on the node.

Instances are the Placement Controller's: the index asks for an instance's URLs through
``instance_urls``, which placement answers (it registers how when the apps load,
``placement.apps``), so that the dependency points from placement to the index and never back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from common.permissions import has_scope_grant
from kvsp.problems import ProtocolError
from kvsp.records import holder_url_rule_broken

# (instance name, URLs or None) -> the instance's URLs, among those URLs when given.
InstanceUrls = Callable[[str, Collection[str] | None], set[str]]

_instance_urls: InstanceUrls | None = None


def answer_instance_urls_with(resolver: InstanceUrls) -> None:
    """Where ``instance_urls`` asks: placement's reading of its instances, set in its
    ``AppConfig.ready``. Until one is set the index knows no instance, and a principal bound
    to one publishes only for the holder URLs it lists."""
    global _instance_urls
    _instance_urls = resolver


def instance_urls(instance: str, among: Collection[str] | None = None) -> set[str]:
    """The URLs of the instance named ``instance`` (among ``among`` when given): one query."""
    if _instance_urls is None:
        return set()
    return _instance_urls(instance, among)


def may_publish_for(principal, holder_url: str) -> bool:
    if holder_url in principal.holder_urls:
        return True
    if not principal.instance:
        return False
    return holder_url in instance_urls(principal.instance, [holder_url])


def publishable_holders(principal, holder_urls) -> frozenset[str]:
    """Which of ``holder_urls`` the principal may publish for (``may_publish_for`` of each, in
    one query at most), for a batch that names many records of few holders."""
    wanted = set(holder_urls)
    allowed = wanted & set(principal.holder_urls)
    if principal.instance and wanted - allowed:
        allowed |= instance_urls(principal.instance, sorted(wanted - allowed))
    return frozenset(allowed)


def _may_publish_for(principal, holder_url: str, publishable: frozenset[str] | None) -> bool:
    # ``publishable``: what ``publishable_holders`` found for a batch; else the database says.
    if publishable is not None:
        return holder_url in publishable
    return may_publish_for(principal, holder_url)


def check_may_publish(principal, record, publishable: frozenset[str] | None = None) -> None:
    if not has_scope_grant(principal, record.scope_id_bytes):
        raise ProtocolError("kvsp-forbidden", "not authorized for the record's scope")
    if not _may_publish_for(principal, record.holder, publishable):
        raise ProtocolError("kvsp-forbidden", f"not authorized to publish for {record.holder}")


def check_may_withdraw(
    principal, scope_id: bytes, holder_url: str, publishable: frozenset[str] | None = None
) -> None:
    if not has_scope_grant(principal, scope_id):
        raise ProtocolError("kvsp-not-found", "no such replica")
    if not _may_publish_for(principal, holder_url, publishable):
        raise ProtocolError("kvsp-forbidden", f"not authorized to withdraw for {holder_url}")


def check_holder_url(url: str) -> str:
    """A holder a principal publishes for is a holder URL by the rules its records are held to."""
    broken = holder_url_rule_broken(url)
    if broken is not None:
        raise ProtocolError("kvsp-malformed-request", f"{url!r} is not a holder URL: {broken}")
    return url
