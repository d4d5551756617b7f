"""The statements an operation sends to Postgres, named, for tests that pin them (STYLE.md: a
lookup that grows a statement per key is caught at once).

Django's ``CaptureQueriesContext`` sees only what goes through Django's cursors; the hot paths
(lookup, placement) also read through psycopg cursors of their own, so the statements are taken
where both end up: ``psycopg.Cursor.execute``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql

# Statements every request of a kind sends, by what they are for.
PRINCIPAL_OF_TOKEN = "SELECT index_principal index_principal_scopes index_scope"
KEPT_CONNECTION_CHECK = "SELECT 1"  # Django's CONN_HEALTH_CHECKS, once per request

_WORD = re.compile(r"\w+")
_QUOTED = re.compile(r'"[^"]*"')
_VERB = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE)\b", re.IGNORECASE)


def _tables() -> frozenset[str]:
    from django.apps import apps

    return frozenset(m._meta.db_table for m in apps.get_models(include_auto_created=True))


def _after_common_table(text: str) -> str:
    """What follows the first common table expression of a ``WITH`` statement."""
    depth, start = 0, text.index("(")
    for position in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[position], 0)
        if depth == 0:
            return text[position + 1 :]
    return ""


def statement_name(text: str) -> str:
    """A statement's verb and the tables it names, in order of first mention:
    ``"SELECT index_principal index_principal_scopes index_scope"``; a ``WITH`` statement's
    verb is its first expression's then its own (``"WITH UPDATE, SELECT workers_storedblock"``);
    a statement that names no table is its text, without quoted names (``"SELECT 1"``,
    ``"SAVEPOINT"``)."""
    text = " ".join(text.split())
    verb = text.split(" ", 1)[0].upper()
    if verb == "WITH":
        first, last = _VERB.search(text), _VERB.search(_after_common_table(text))
        verb = f"WITH {first.group(1).upper()}, {last.group(1).upper()}"
    known = _tables()
    tables = [word for word in dict.fromkeys(_WORD.findall(text)) if word in known]
    return " ".join([verb, *tables]) if tables else _QUOTED.sub("", text).strip()


@contextmanager
def statements_sent() -> Iterator[list[str]]:
    """The names (``statement_name``) of the statements executed inside the block, in order."""
    sent: list[str] = []
    execute = psycopg.Cursor.execute

    def named(cursor, query, *args, **kwargs):
        if isinstance(query, sql.Composable):
            text = query.as_string(cursor)
        elif isinstance(query, bytes):
            text = query.decode()
        else:
            text = str(query)
        sent.append(statement_name(text))
        return execute(cursor, query, *args, **kwargs)

    psycopg.Cursor.execute = named
    try:
        yield sent
    finally:
        psycopg.Cursor.execute = execute
