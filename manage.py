#!/usr/bin/env python
"""Django's command-line utility for KVSP: both roles, chosen by KVSP_ROLE."""

import os
import sys


def main():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvspsite.settings")
    from django.core.exceptions import ImproperlyConfigured

    try:
        from django.conf import settings

        settings.INSTALLED_APPS  # noqa: B018 - read the environment now, to fail in one line
    except ImproperlyConfigured as exc:
        print(f"kvsp: configuration error: {exc}", file=sys.stderr)
        sys.exit(2)
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
