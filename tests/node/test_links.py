"""The node's measured links (6.3 "links"): one row per holder, whatever the concurrency, and
figures that measure the transfers, not what the node does around them."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connections

from workers import instance
from workers.links import LinkMeter, Transfer, link_figures
from workers.models import MeasuredLink


@pytest.mark.django_db(transaction=True)
def test_loads_measuring_a_new_link_at_once_make_one_row_with_every_sample():
    """A prefetch and a reshard load may finish together and both measure a holder the node
    has not measured yet: neither fails, and the link has both samples."""
    loads = 8
    barrier = threading.Barrier(loads)

    def measure(_):
        try:
            barrier.wait()
            instance.do_record_link("links-node", "http://h.test/kvsp/", rtt_us=100, mbit_per_s=800)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(loads) as pool:
        list(pool.map(measure, range(loads)))
    (link,) = MeasuredLink.objects.filter(instance="links-node")
    assert (link.samples, link.rtt_us, link.mbit_per_s) == (loads, 100, 800)


def transfer(head_at, last_octet_at, octets, head_s=0.001):
    return Transfer(head_at=head_at, last_octet_at=last_octet_at, head_s=head_s, octets=octets)


def test_transfers_side_by_side_count_once():
    # Four bodies of 1 MB in the same second: the link carried 4 MB in that second.
    together = [transfer(10.0, 11.0, 1_000_000) for _ in range(4)]
    assert link_figures(together).mbit_per_s == 32.0


def test_time_between_transfers_is_not_the_link_s():
    # Storing and publishing took 5 s between two 1-second transfers of 1 MB each.
    apart = [transfer(10.0, 11.0, 1_000_000), transfer(16.0, 17.0, 1_000_000)]
    assert link_figures(apart).mbit_per_s == 8.0


def test_overlapping_transfers_count_their_union():
    staggered = [transfer(0.0, 2.0, 1_000_000), transfer(1.0, 3.0, 1_000_000)]
    assert link_figures(staggered).mbit_per_s == 16 / 3
    inside = [transfer(0.0, 4.0, 1_000_000), transfer(1.0, 2.0, 1_000_000)]
    assert link_figures(inside).mbit_per_s == 4.0


def test_the_round_trip_is_the_quickest_response_head():
    figures = link_figures([transfer(0, 1, 10, head_s=0.004), transfer(0, 1, 10, head_s=0.002)])
    assert figures.rtt_us == 2000.0


def test_a_meter_keeps_holders_apart_and_skips_empty_ones():
    meter = LinkMeter()
    meter.add("http://a.test/kvsp/", transfer(0.0, 1.0, 125_000))
    meter.add("http://b.test/kvsp/", transfer(0.0, 2.0, 125_000))
    meter.add("http://c.test/kvsp/", transfer(0.0, 1.0, 0))
    figures = meter.figures()
    assert set(figures) == {"http://a.test/kvsp/", "http://b.test/kvsp/"}
    assert figures["http://a.test/kvsp/"].mbit_per_s == 1.0
    assert figures["http://b.test/kvsp/"].mbit_per_s == 0.5
