"""The node's measured links (6.3 "links"): one row per holder, whatever the concurrency."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connections

from workers import services
from workers.models import MeasuredLink

pytestmark = pytest.mark.django_db(transaction=True)


def test_loads_measuring_a_new_link_at_once_make_one_row_with_every_sample():
    """A prefetch and a reshard load may finish together and both measure a holder the node
    has not measured yet: neither fails, and the link has both samples."""
    loads = 8
    barrier = threading.Barrier(loads)

    def measure(_):
        try:
            barrier.wait()
            services.do_record_link("links-node", "http://h.test/kvsp/", rtt_us=100, mbit_per_s=800)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(loads) as pool:
        list(pool.map(measure, range(loads)))
    (link,) = MeasuredLink.objects.filter(instance="links-node")
    assert (link.samples, link.rtt_us, link.mbit_per_s) == (loads, 100, 800)
