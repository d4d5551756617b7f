"""Housekeeping of the Index Service."""

from common.tasks import add_housekeeping, kvsp_task
from index import services


@kvsp_task(name="index.delete_expired_replicas", time_limit=120)
def delete_expired_replicas():
    return services.do_delete_expired_replicas()


add_housekeeping("delete-expired-replicas", "index.delete_expired_replicas", 30.0)


@kvsp_task(name="index.prune_lookup_buckets", time_limit=120, max_retries=0)
def prune_lookup_buckets():
    return services.do_prune_lookup_buckets()


add_housekeeping("prune-lookup-buckets", "index.prune_lookup_buckets", 3600.0)
