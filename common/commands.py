"""A base for the project's management commands: JSON on stdout, bad input in one line, exit 2."""

from __future__ import annotations

import json
import sys

from django.core.management.base import BaseCommand, CommandError, CommandParser

from kvsp.problems import ProtocolError


class OneLineParser(CommandParser):
    """Usage errors as one CommandError line instead of argparse's usage block."""

    def error(self, message):
        raise CommandError(f"{self.prog}: {message}", returncode=2)


class JsonCommand(BaseCommand):
    """Subclasses implement ``run(**options)`` returning a JSON-serialisable value."""

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.__class__ = OneLineParser
        return parser

    def add_subcommands(self, parser):
        return parser.add_subparsers(dest="action", required=True, parser_class=OneLineParser)

    def handle(self, *args, **options):
        try:
            result = self.run(**options)
        except ProtocolError as exc:
            raise CommandError(exc.detail, returncode=2) from None
        self.stdout.write(json.dumps(result))

    def run_from_argv(self, argv):
        try:
            super().run_from_argv(argv)
        except CommandError as exc:  # raised while parsing, before Django's own handler
            sys.stderr.write(f"CommandError: {exc}\n")
            sys.exit(exc.returncode)

    def run(self, **options):
        raise NotImplementedError
