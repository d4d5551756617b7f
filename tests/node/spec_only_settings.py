"""A control plane that speaks only the spec: the project's settings with a URLconf that has no
batch publication route (``tests.node.spec_only_urls``)."""

from kvspsite.settings import *  # noqa: F403

ROOT_URLCONF = "tests.node.spec_only_urls"
