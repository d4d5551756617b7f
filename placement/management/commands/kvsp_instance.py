from common.commands import JsonCommand
from placement import services
from placement.models import Instance


class Command(JsonCommand):
    help = "Register or list inference instances (spec 6.3). Prints JSON."

    def add_arguments(self, parser):
        actions = self.add_subcommands(parser)
        add = actions.add_parser("add", help="register an instance by name and base URL")
        add.add_argument("name")
        add.add_argument("--url", required=True, help="its base URL, e.g. http://ii1:8001/kvsp/")
        add.add_argument(
            "--compat", action="append", default=[], help="a Compatibility ID it serves (hex32)"
        )
        actions.add_parser("list", help="list instances")

    def run(self, action, **options):
        if action == "list":
            return [
                {"name": i.name, "url": i.url, "state": i.state, "epoch": i.epoch}
                for i in Instance.objects.all()
            ]
        instance = services.do_register_instance(
            options["name"], options["url"], compat_ids=options["compat"]
        )
        return {"name": instance.name, "url": instance.url}
