"""``python -m kvsp``: see kvsp.cli."""

from kvsp.cli import main

raise SystemExit(main())
