"""``manage.py kvsp_cluster``: a whole cluster on this machine (devtools/localcluster.py)."""

import json
from pathlib import Path

from django.core.management.base import BaseCommand

from devtools.localcluster import ClusterError, LocalCluster

# How long the instances are watched after the run, for the summary: longer than a status TTL
# and a keeper round, so that a node that stalls shows.
HEALTH_CHECK_S = 8.0


class Command(BaseCommand):
    help = (
        "Start a control plane and nodes with the reference engine, drive a workload with shared "
        "prefixes, kill a node mid-session, reshard, print a summary, and keep the dashboard up "
        "until Ctrl-C."
    )

    def add_arguments(self, parser):
        parser.add_argument("--nodes", type=int, default=3, help="nodes to start (at least 2)")
        parser.add_argument("--requests", type=int, default=12, help="prompts in the workload")
        parser.add_argument(
            "--short",
            action="store_true",
            help="a quick run that stops after the summary (what CI runs)",
        )
        parser.add_argument("--json", action="store_true", help="print the summary as JSON")
        parser.add_argument(
            "--dir",
            type=Path,
            default=None,
            help="where the embedded default keeps its files (default var/cluster, emptied first)",
        )

    def handle(self, *args, nodes, requests, short, **options):
        if nodes < 2:
            self.stderr.write("kvsp_cluster: --nodes must be at least 2")
            raise SystemExit(2)
        cluster = LocalCluster(
            nodes=nodes, requests=4 if short else requests, directory=options["dir"]
        )
        try:
            cluster.start()
            cluster.run_workload()
            cluster.show_failover()
            cluster.show_reshard()
            cluster.check_instances(HEALTH_CHECK_S)
            cluster.console.print(cluster.summary())
            if options["json"]:
                self.stdout.write(json.dumps(cluster.summary_json()))
            if not short:
                cluster.wait_for_interrupt(
                    f"Dashboard: {cluster.dashboard_url()}  (user {cluster.admin_user}, "
                    f"password {cluster.admin_password}); Ctrl-C stops the cluster."
                )
        except ClusterError as error:
            self.stderr.write(f"kvsp_cluster: {error}")
            raise SystemExit(1) from None
        except KeyboardInterrupt:
            self.stderr.write("kvsp_cluster: interrupted")
            raise SystemExit(130) from None
        finally:
            cluster.stop()
