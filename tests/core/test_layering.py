"""`kvsp/` is plain Python: no Django, Celery, database or socket module, and torch only lazily."""

import json
import pkgutil
import subprocess

import kvsp
from tests.support.processes import PYTHON, ROOT

FORBIDDEN = ("django", "rest_framework", "celery", "kombu", "psycopg", "redis", "socket", "torch")


def test_core_imports_nothing_forbidden():
    modules = [
        f"kvsp.{m.name}" for m in pkgutil.iter_modules(kvsp.__path__) if m.name != "__main__"
    ]
    assert "kvsp.container" in modules and "kvsp.records" in modules
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))"
    )
    result = subprocess.run(
        [PYTHON, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
