"""`kvsp/` is plain Python: no Django, Celery, database or socket module, and torch only lazily.
`kvsp_vllm/`, the vLLM connector, runs inside vLLM's processes: it imports the core, httpx, torch
and vLLM, and reaches the roles over HTTP only, never through Django or the project's apps."""

import ast
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import kvsp
import kvsp_vllm
from tests.support.processes import PYTHON, ROOT

FORBIDDEN = ("django", "rest_framework", "celery", "kombu", "psycopg", "redis", "socket", "torch")
PROJECT_APPS = ("index", "placement", "sessions", "workers", "common", "kvspsite", "dashboard")
VLLM_CONNECTOR_IMPORTS = {"kvsp", "kvsp_vllm", "httpx", "torch", "vllm", "__future__"}


def loaded_after_importing(modules: list[str], watched: tuple[str, ...]) -> list[str]:
    """The modules of the ``watched`` packages a fresh interpreter holds after importing."""
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {watched!r})))"
    )
    result = subprocess.run(
        [PYTHON, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_core_imports_nothing_forbidden():
    modules = [
        f"kvsp.{m.name}" for m in pkgutil.iter_modules(kvsp.__path__) if m.name != "__main__"
    ]
    assert "kvsp.container" in modules and "kvsp.records" in modules
    assert loaded_after_importing(modules, FORBIDDEN) == []


def test_the_vllm_connector_names_only_the_core_httpx_torch_and_vllm():
    files = sorted(Path(kvsp_vllm.__path__[0]).glob("*.py"))
    assert {path.name for path in files} >= {"connector.py", "client.py", "layouts.py"}
    imported = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    assert imported - VLLM_CONNECTOR_IMPORTS - sys.stdlib_module_names == set()


def test_the_vllm_connector_loads_no_django():
    # kvsp_vllm.connector needs vLLM, which lives in its own environment (.venv-vllm); the
    # names it imports are checked above.
    modules = [
        f"kvsp_vllm.{m.name}"
        for m in pkgutil.iter_modules(kvsp_vllm.__path__)
        if m.name != "connector"
    ]
    assert "kvsp_vllm.client" in modules and "kvsp_vllm.layouts" in modules
    assert loaded_after_importing(modules, FORBIDDEN[:-2] + PROJECT_APPS) == []


def test_every_layer_imports_only_the_layers_below_it():
    # The contracts are in pyproject.toml: the layers of DESIGN.md section 2, the node's reach
    # into the index, and the plain-Python core and connector.
    lint_imports = Path(PYTHON).with_name("lint-imports")
    result = subprocess.run(
        [lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"Contracts: \d+ kept, 0 broken", result.stdout), result.stdout[-4000:]
