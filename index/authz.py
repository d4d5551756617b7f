"""Who may do what in the Index Service (spec 6.1, 6.2; DESIGN.md section 6).

A principal reads a scope it is granted (the controller reads every scope), publishes for the
holder URLs it lists or for the URL of the instance it is bound to, and is told about another
scope's data exactly what it would be told if the data did not exist.
"""

from __future__ import annotations

from kvsp.problems import ProtocolError
from kvsp.records import holder_url_rule_broken


def may_read_scope(principal, scope_id: bytes) -> bool:
    return principal.controller or bytes(scope_id) in principal.scope_ids


def may_publish_for(principal, holder_url: str) -> bool:
    if holder_url in principal.holder_urls:
        return True
    if not principal.instance:
        return False
    from placement.models import Instance

    return Instance.objects.filter(name=principal.instance, url=holder_url).exists()


def publishable_holders(principal, holder_urls) -> frozenset[str]:
    """Which of ``holder_urls`` the principal may publish for (``may_publish_for`` of each, in
    one query at most), for a batch that names many records of few holders."""
    wanted = set(holder_urls)
    allowed = wanted & set(principal.holder_urls)
    if principal.instance and wanted - allowed:
        from placement.models import Instance

        allowed |= set(
            Instance.objects.filter(
                name=principal.instance, url__in=sorted(wanted - allowed)
            ).values_list("url", flat=True)
        )
    return frozenset(allowed)


def _may_publish_for(principal, holder_url: str, publishable: frozenset[str] | None) -> bool:
    # ``publishable``: what ``publishable_holders`` found for a batch; else the database says.
    if publishable is not None:
        return holder_url in publishable
    return may_publish_for(principal, holder_url)


def check_may_publish(principal, record, publishable: frozenset[str] | None = None) -> None:
    if record.scope_id_bytes not in principal.scope_ids:
        raise ProtocolError("kvsp-forbidden", "not authorized for the record's scope")
    if not _may_publish_for(principal, record.holder, publishable):
        raise ProtocolError("kvsp-forbidden", f"not authorized to publish for {record.holder}")


def check_may_withdraw(
    principal, scope_id: bytes, holder_url: str, publishable: frozenset[str] | None = None
) -> None:
    if bytes(scope_id) not in principal.scope_ids:
        raise ProtocolError("kvsp-not-found", "no such replica")
    if not _may_publish_for(principal, holder_url, publishable):
        raise ProtocolError("kvsp-forbidden", f"not authorized to withdraw for {holder_url}")


def check_holder_url(url: str) -> str:
    """A holder a principal publishes for is a holder URL by the rules its records are held to."""
    broken = holder_url_rule_broken(url)
    if broken is not None:
        raise ProtocolError("kvsp-malformed-request", f"{url!r} is not a holder URL: {broken}")
    return url
