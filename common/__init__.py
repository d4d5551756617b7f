"""What the apps share: the DRF plumbing and problem details (``api``), the one client for
peers (``peers``), the permissions every app applies alike (``permissions``), task declaration
and queues (``tasks``), metrics, throttling, URL converters, the management-command base, the
OpenAPI hooks and the ASGI bridge. It imports the core
(``kvsp``) and no app; the apps import it, never ``kvspsite``, which is the site's wiring alone.
"""
