from django.core.management.base import CommandError
from django.utils import timezone

from common.commands import JsonCommand
from index import services
from index.models import Principal
from kvsp.hexids import is_hex


class Command(JsonCommand):
    help = "Create, list or revoke principals (DESIGN.md section 6). Prints JSON."

    def add_arguments(self, parser):
        actions = self.add_subcommands(parser)
        create = actions.add_parser("create", help="create a principal and print its token once")
        create.add_argument("name")
        create.add_argument(
            "--scope", action="append", default=[], help="a scope id (hex16) to grant"
        )
        create.add_argument(
            "--holder", action="append", default=[], help="a holder URL it may publish for"
        )
        create.add_argument("--instance", default="", help="the instance it speaks for")
        create.add_argument("--controller", action="store_true", help="the Placement Controller")
        revoke = actions.add_parser("revoke", help="revoke a principal's token")
        revoke.add_argument("name")
        actions.add_parser("list", help="list principals")

    def run(self, action, **options):
        if action == "list":
            return [
                {
                    "name": p.name,
                    "scopes": sorted(s.scope_id_hex for s in p.scopes.all()),
                    "holders": p.holder_urls,
                    "instance": p.instance,
                    "controller": p.controller,
                    "revoked": p.revoked_at is not None,
                }
                for p in Principal.objects.prefetch_related("scopes")
            ]
        if action == "revoke":
            updated = Principal.objects.filter(
                name=options["name"], revoked_at__isnull=True
            ).update(revoked_at=timezone.now())
            if not updated:
                raise CommandError(f"no active principal {options['name']!r}", returncode=2)
            return {"name": options["name"], "revoked": True}
        for scope in options["scope"]:
            if not is_hex(scope, 16):
                raise CommandError(f"--scope {scope!r} is not a hex16 scope id", returncode=2)
        issued = services.do_create_principal(
            options["name"],
            scope_ids=[bytes.fromhex(s) for s in options["scope"]],
            holder_urls=options["holder"],
            instance=options["instance"],
            controller=options["controller"],
        )
        return {"name": issued.principal.name, "token": issued.token}
