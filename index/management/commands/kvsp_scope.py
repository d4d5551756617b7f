from django.core.management.base import CommandError

from common.commands import JsonCommand
from index import services
from index.models import Scope


class Command(JsonCommand):
    help = "Create or list scopes (spec 4.2). Prints JSON."

    def add_arguments(self, parser):
        actions = self.add_subcommands(parser)
        create = actions.add_parser("create", help="create a scope with a new or given key")
        create.add_argument("name")
        create.add_argument("--key-hex", help="the scope key, at least 32 octets, in hex")
        create.add_argument(
            "--shared-prefix", action="store_true", help="a scope for a public shared prefix"
        )
        actions.add_parser("list", help="list scopes")

    def run(self, action, **options):
        if action == "list":
            return [
                {"scope_id": s.scope_id_hex, "name": s.name, "shared_prefix": s.shared_prefix}
                for s in Scope.objects.all()
            ]
        key = None
        if options["key_hex"] is not None:
            try:
                key = bytes.fromhex(options["key_hex"])
            except ValueError:
                raise CommandError("--key-hex is not hex", returncode=2) from None
        scope = services.do_create_scope(
            options["name"], scope_key=key, shared_prefix=options["shared_prefix"]
        )
        return {"scope_id": scope.scope_id_hex, "name": scope.name}
