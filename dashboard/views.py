"""Pages, live JSON and actions of the operator dashboard.

Operators log in with Django's own login (the admin's) and must be staff. Every page has a JSON
twin under ``live/`` that the page polls: the same sections rendered again, the series of its
charts, and rows to append (a session's new tokens). Actions are forms posted to their own URLs;
each calls the service function the API calls and comes back to the page with a message.
"""

from __future__ import annotations

import json
from functools import wraps

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.http import JsonResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.templatetags.static import static
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST, require_safe

import index.selectors
import index.services
import placement.selectors
import placement.services
import sessions.selectors
from dashboard import sections
from dashboard.sections import Page
from index.models import Tier
from kvsp.numerals import parse_decimal
from kvsp.problems import ProtocolError
from kvsp.records import StateChange
from placement import resharding
from placement.models import InstanceState
from sessions.services import parse_session_id

# How often a page asks for its live JSON.
REFRESH_MS = 2000
# Tokens a session page shows when it opens, and at most per refresh.
TOKENS_SHOWN = 2000
TOKENS_PER_REFRESH = 4096


def favicon(request):
    """Browsers ask for /favicon.ico on every page, the admin's included."""
    return redirect(static("dashboard/favicon.svg"), permanent=True)


def staff_json(view):
    """Like ``staff_member_required``, but a page's poller gets JSON it can act on, not the
    login page."""

    @wraps(view)
    def guarded(request, *args, **kwargs):
        if not (request.user.is_active and request.user.is_staff):
            return JsonResponse({"detail": "not logged in as staff: reload to log in"}, status=403)
        return view(request, *args, **kwargs)

    return guarded


def _shown(page: Page, page_sections) -> list[dict]:
    return [
        {
            "name": section.name,
            "title": section.title,
            "template": section.template,
            "charts": section.charts,
            "data": section.data(page),
        }
        for section in page_sections
    ]


def _render_page(request, template: str, page_sections, page: Page, live_url: str, **context):
    context.update(
        sections=_shown(page, page_sections),
        live_url=live_url,
        refresh_ms=REFRESH_MS,
        page=page,
    )
    return render(request, template, context)


def _live(request, page_sections, page: Page, **members) -> JsonResponse:
    html, series = {}, {}
    for section in page_sections:
        html[section.name] = render_to_string(
            section.template, {"data": section.data(page)}, request
        )
        for chart in section.charts:
            lines = chart.lines(page)
            window = sections.chart_window(page, lines)
            series[chart.name] = {"unit": chart.unit, "window": window, "lines": lines}
    document = {"html": html, "series": series, "generated_at": page.now.isoformat()}
    document.update(members)
    return JsonResponse(document)


def _missing(request, message: str):
    return render(request, "dashboard/missing.html", {"message": message}, status=404)


def _missing_json(message: str):
    return JsonResponse({"detail": message}, status=404)


def _live_view(page_sections, find_page, missing: str):
    """The live JSON of the pages ``find_page`` finds from the URL's arguments; a 404 saying
    ``missing`` (formatted with them) where it finds none."""

    @require_safe
    @staff_json
    def live(request, **arguments):
        page = find_page(**arguments)
        if page is None:
            return _missing_json(missing.format(**arguments))
        return _live(request, page_sections, page)

    return live


def _back(request, default: str):
    """Where an action returns to: the page it was posted from, if it is one of ours."""
    target = request.POST.get("return_to", "")
    if url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return redirect(target)
    return redirect(default)


def _refused(request, default: str, message: str):
    """Back where an action came from, with why it was not done."""
    messages.error(request, message)
    return _back(request, default)


# --- Overview ---------------------------------------------------------------------------------


def _overview_page() -> Page:
    return Page(timezone.now(), reverse("dashboard:overview"))


@require_safe
@staff_member_required
def overview(request):
    return _render_page(
        request,
        "dashboard/overview.html",
        sections.OVERVIEW,
        _overview_page(),
        reverse("dashboard:live-overview"),
    )


@require_safe
@staff_json
def live_overview(request):
    return _live(request, sections.OVERVIEW, _overview_page())


# --- One instance -----------------------------------------------------------------------------


def _instance_page(name: str) -> Page | None:
    instance = placement.selectors.instance_by_name(name)
    if instance is None:
        return None
    return Page(timezone.now(), reverse("dashboard:instance", args=[name]), instance=instance)


@require_safe
@staff_member_required
def instance(request, name: str):
    page = _instance_page(name)
    if page is None:
        return _missing(request, f"No instance named {name!r} is registered.")
    return _render_page(
        request,
        "dashboard/instance.html",
        sections.INSTANCE,
        page,
        reverse("dashboard:live-instance", args=[name]),
        instance=page.instance,
    )


live_instance = _live_view(
    sections.INSTANCE, _instance_page, "no instance named {name!r} is registered"
)


@require_POST
@staff_member_required
def change_state(request, name: str):
    """Drain, sleep or wake an instance (6.3), as ``PUT instances/{name}/state`` does."""
    default = reverse("dashboard:instance", args=[name])
    if not request.user.has_perm("placement.change_instance"):
        return _refused(request, default, "You may not change the state of instances.")
    requested = request.POST.get("state", "")
    try:
        change = StateChange.from_json({"state": requested})
        changed = placement.services.do_change_state(name, change.state)
    except ProtocolError as error:
        return _refused(request, default, f"{name}: {error.detail}")
    if requested == InstanceState.SLEEPING and changed.state == InstanceState.DRAINING:
        messages.success(request, f"{name} is draining; it sleeps once its sessions are done.")
    else:
        messages.success(request, f"{name} is {changed.state}.")
    return _back(request, default)


# --- One session ------------------------------------------------------------------------------


def _session_page(session_id: str) -> tuple[Page | None, str]:
    try:
        key = parse_session_id(session_id)
    except ProtocolError:
        return None, f"{session_id!r} is not a session id (a UUID)."
    session = sessions.selectors.session_by_id(key)
    if session is None:
        return None, f"No session {key} is known."
    return Page(timezone.now(), reverse("dashboard:session", args=[key]), session=session), ""


def _after(tokens, after: int) -> int:
    return tokens[-1].index if tokens else after


@require_safe
@staff_member_required
def session(request, session_id: str):
    page, problem = _session_page(session_id)
    if page is None:
        return _missing(request, problem)
    tokens = sessions.selectors.tokens(page.session, limit=TOKENS_SHOWN)
    return _render_page(
        request,
        "dashboard/session.html",
        sections.SESSION,
        page,
        reverse("dashboard:live-session", args=[page.session.session]),
        session=page.session,
        tokens=tokens,
        truncated=page.session.delivered > len(tokens),
        cursor_json=json.dumps({"after": _after(tokens, -1)}),
    )


@require_safe
@staff_json
def live_session(request, session_id: str):
    page, problem = _session_page(session_id)
    if page is None:
        return _missing_json(problem)
    try:
        after = parse_decimal(request.GET.get("after", "-1"), "after", minimum=-1)
    except ProtocolError as error:
        return JsonResponse({"detail": error.detail}, status=400)
    tokens = sessions.selectors.tokens(page.session, after=after)[:TOKENS_PER_REFRESH]
    appended = render_to_string("dashboard/tokens.html", {"tokens": tokens}, request)
    return _live(
        request,
        sections.SESSION,
        page,
        append={"tokens": appended} if tokens else {},
        cursor={"after": _after(tokens, after)},
    )


# --- One holder and its replicas --------------------------------------------------------------


def _holder_page(holder_id: int) -> Page | None:
    holder = index.selectors.holder_by_id(holder_id)
    if holder is None:
        return None
    return Page(timezone.now(), reverse("dashboard:holder", args=[holder_id]), holder=holder)


_TIERS = {tier.label: tier for tier in Tier}


@require_safe
@staff_member_required
def holder(request, holder_id: int):
    page = _holder_page(holder_id)
    if page is None:
        return _missing(request, f"No holder {holder_id} is known.")
    tier_name = request.GET.get("tier", "")
    if tier_name and tier_name not in _TIERS:
        messages.error(request, f"{tier_name!r} is not a tier; showing every tier.")
        tier_name = ""
    replicas = index.selectors.holder_replicas(
        holder_id, tier=_TIERS.get(tier_name), limit=sections.HOLDER_REPLICAS, now=page.now
    )
    return _render_page(
        request,
        "dashboard/holder.html",
        sections.HOLDER,
        page,
        reverse("dashboard:live-holder", args=[holder_id]),
        holder=page.holder,
        replicas=[sections.replica_row(r, page.now) for r in replicas],
        tier=tier_name,
        tiers=list(_TIERS),
        limit=sections.HOLDER_REPLICAS,
    )


live_holder = _live_view(sections.HOLDER, _holder_page, "no holder {holder_id} is known")


@require_POST
@staff_member_required
def withdraw_replicas(request, holder_id: int):
    """Withdraw replicas of one holder (6.1), as the admin's withdraw action does."""
    default = reverse("dashboard:holder", args=[holder_id])
    if not request.user.has_perm("index.delete_replica"):
        return _refused(request, default, "You may not withdraw replicas.")
    try:
        chosen = [parse_decimal(value, "replica") for value in request.POST.getlist("replica")]
    except ProtocolError:
        return _refused(request, default, "The replicas to withdraw were not given as ids.")
    if not chosen:
        return _refused(request, default, "Choose the replicas to withdraw first.")
    withdrawn = index.services.do_withdraw_replicas(
        index.selectors.replica_ids_at(holder_id, chosen)
    )
    messages.success(request, f"Withdrew {withdrawn} replica(s).")
    return _back(request, default)


# --- Reshards ---------------------------------------------------------------------------------


@require_POST
@staff_member_required
def abort_reshard(request, operation_id: int):
    """Abort a reshard still preparing (6.9); the members are told by the PC's driver."""
    default = reverse("dashboard:overview") + "#shardmaps"
    if not request.user.has_perm("placement.change_reshardoperation"):
        return _refused(request, default, "You may not abort reshards.")
    operation = placement.selectors.reshard_operation(operation_id)
    if operation is None:
        return _refused(request, default, f"No reshard operation {operation_id} is known.")
    name = f"{operation.shard_map.map} v{operation.from_version} → v{operation.to_version}"
    try:
        aborted = resharding.do_abort_reshard(operation_id)
    except ProtocolError as error:
        return _refused(request, default, f"Reshard {name}: {error.detail}")
    messages.success(request, f"Reshard {name} is {aborted.phase}.")
    return _back(request, default)
