"""Settings for both roles, read from the environment once (DESIGN.md section 7).

With no environment at all this is the embedded default: SQLite and a filesystem broker under
``var/``, development secrets generated once under ``var/secrets/``. Production sets
``KVSP_PRODUCTION=1`` with ``DATABASE_URL`` (Postgres), ``CELERY_BROKER_URL`` (Redis) and real
secrets; a missing secret then stops start-up.
"""

from __future__ import annotations

import base64
import secrets
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

VAR_DIR = Path(env.str("KVSP_VAR_DIR", default=str(BASE_DIR / "var")))
PRODUCTION = env.bool("KVSP_PRODUCTION", default=False)
DEBUG = env.bool("DJANGO_DEBUG", default=False)

ROLES = ("control", "node")
KVSP_ROLE = env.str("KVSP_ROLE", default="control")
if KVSP_ROLE not in ROLES:
    raise ImproperlyConfigured(
        f"KVSP_ROLE={KVSP_ROLE!r} is not a role; use one of: {', '.join(ROLES)}"
    )


def _development_secret(name: str, octets: int) -> str:
    """A secret generated once per checkout, so that every local process agrees on it."""
    if PRODUCTION:
        raise ImproperlyConfigured(f"{name} must be set when KVSP_PRODUCTION is on")
    path = VAR_DIR / "secrets" / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        value = base64.b64encode(secrets.token_bytes(octets)).decode()
        try:
            with path.open("x") as handle:
                handle.write(value)
        except FileExistsError:
            pass  # another process created it first; read theirs
    return path.read_text().strip()


def _env_or_development_secret(name: str, octets: int) -> str:
    value = env.str(name, default="")
    return value or _development_secret(name, octets)


_AES_KEY_OCTETS = (16, 24, 32)
_MASTER_KEY_FORMS = "'hex:' or 'base64:' followed by the key, or the key in base64 or hex alone"


def _decoded(raw: str, form: str) -> bytes | None:
    try:
        return base64.b64decode(raw, validate=True) if form == "base64" else bytes.fromhex(raw)
    except ValueError:
        return None


def _master_key() -> bytes:
    """The AES key from ``hex:...``, ``base64:...`` or an unprefixed value.

    An unprefixed value is read as base64 wherever that gives a key, as it always was, so no
    stored scope key becomes unreadable; 64 hex digits are also valid base64 (48 octets), so
    it is read as hex only where base64 gives no key of a right length and hex does.
    """
    raw = _env_or_development_secret("KVSP_MASTER_KEY", 32)
    form, sep, value = raw.partition(":")
    if sep and form in ("hex", "base64"):
        forms = (form,)
    else:
        forms, value = ("base64", "hex"), raw
    for form in forms:
        key = _decoded(value, form)
        if key is not None and len(key) in _AES_KEY_OCTETS:
            return key
    raise ImproperlyConfigured(
        f"KVSP_MASTER_KEY must be an AES key of 16, 24 or 32 octets: {_MASTER_KEY_FORMS}"
    )


def _non_negative_setting(name: str, default, read, kind: str):
    """The setting ``name`` as ``read`` (env.int or env.float) reads it, ``kind`` naming what
    it must be; never below 0."""
    try:
        value = read(name, default=default)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={env.str(name)!r} is not {kind}") from None
    if value < 0:
        raise ImproperlyConfigured(f"{name}={value} must not be negative")
    return value


def _int_setting(name: str, default: int) -> int:
    return _non_negative_setting(name, default, env.int, "an integer")


def _float_setting(name: str, default: float) -> float:
    return _non_negative_setting(name, default, env.float, "a number")


def _url_setting(name: str, default: str, schemes: tuple[str, ...]) -> str:
    value = env.str(name, default=default)
    scheme, sep, _ = value.partition("://")
    if not sep or scheme not in schemes:
        raise ImproperlyConfigured(
            f"{name}={value!r} is not a URL with one of the schemes: {', '.join(schemes)}"
        )
    return value


SECRET_KEY = _env_or_development_secret("DJANGO_SECRET_KEY", 48)
KVSP_MASTER_KEY = _master_key()

ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["*"] if not PRODUCTION else [])
CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "common",
    "index",
    "placement",
    "sessions.apps.KvspSessionsConfig",
    "workers",
    "dashboard",
    "devtools",
]

# Middleware per role. The control plane serves the admin and the dashboard (HTML pages, static
# files, logins, forms): it needs sessions, CSRF, authentication, messages and the frame guard.
# A node serves only the API (bearer tokens, no cookies, no forms, no HTML, no static files;
# kvspsite/urls_node.py), and every middleware runs on each of a loader's thousands of block
# GETs: it keeps the security headers (SecurityMiddleware: nosniff, Referrer-Policy), the
# request metrics, problem details, and CommonMiddleware (ALLOWED_HOSTS, Content-Length).
MIDDLEWARE_BY_ROLE = {
    "control": [
        "django.middleware.security.SecurityMiddleware",
        "whitenoise.middleware.WhiteNoiseMiddleware",
        "common.metrics.RequestMetricsMiddleware",
        "common.api.ProblemDetailsMiddleware",
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.middleware.common.CommonMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
        "django.middleware.clickjacking.XFrameOptionsMiddleware",
    ],
    "node": [
        "django.middleware.security.SecurityMiddleware",
        "common.metrics.RequestMetricsMiddleware",
        "common.api.ProblemDetailsMiddleware",
        "django.middleware.common.CommonMiddleware",
    ],
}
MIDDLEWARE = MIDDLEWARE_BY_ROLE[KVSP_ROLE]
if KVSP_ROLE == "node":
    # The admin app stays installed on a node (its models and migrations are shared), but the
    # node serves no admin site: the checks that it has the middleware of one do not apply.
    SILENCED_SYSTEM_CHECKS = ["admin.E408", "admin.E409", "admin.E410"]

ROOT_URLCONF = f"kvspsite.urls_{KVSP_ROLE}"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "kvspsite.wsgi.application"
ASGI_APPLICATION = "kvspsite.asgi.application"

_database_url = _url_setting(
    "DATABASE_URL",
    f"sqlite:///{VAR_DIR / 'kvsp.sqlite3'}",
    ("sqlite", "postgres", "postgresql", "pgsql", "psql"),
)
DATABASES = {"default": env.db_url_config(_database_url)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    Path(DATABASES["default"]["NAME"]).parent.mkdir(parents=True, exist_ok=True)
    # The embedded default serves every process of a local cluster from one file. WAL lets
    # readers run beside the one writer; writes take the lock at BEGIN (IMMEDIATE), so a
    # transaction never fails half way for want of it; no transaction makes a network call.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
        }
    )
    # A file, not memory, so that servers started by the tests share the test database.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test-kvsp.sqlite3")}
else:
    DATABASES["default"]["CONN_MAX_AGE"] = _int_setting("KVSP_DB_CONN_MAX_AGE", 60)
    # Server-side binding: digests travel as binary parameters instead of escaped text.
    DATABASES["default"].setdefault("OPTIONS", {})["server_side_binding"] = True
    # A statement a connection has run this many times is prepared on the server (psycopg's
    # automatic preparation), so that its next runs skip parsing and planning: the block
    # GET's read and touch went from 340-400 to 155-205 us a round trip. Django leaves it off
    # for poolers in transaction mode, where a prepared statement may meet another session;
    # behind one, set 0.
    _prepare_after = _int_setting("KVSP_DB_PREPARE_AFTER", 5)
    DATABASES["default"]["OPTIONS"]["prepare_threshold"] = _prepare_after or None
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
STATICFILES_DIRS = [BASE_DIR / "static"] if (BASE_DIR / "static").is_dir() else []
WHITENOISE_USE_FINDERS = True

LOGIN_URL = "/admin/login/"

DATA_UPLOAD_MAX_MEMORY_SIZE = _int_setting("KVSP_MAX_BODY_OCTETS", 4 * 1024 * 1024)

# --- KVSP protocol settings -------------------------------------------------------------------

KVSP_MAX_TTL_MS = _int_setting("KVSP_MAX_TTL_MS", 600_000)
KVSP_LEASE_MAX_OCTETS = _int_setting("KVSP_LEASE_MAX_OCTETS", 8 * 1024**3)
KVSP_LEASE_MAX_TTL_MS = _int_setting("KVSP_LEASE_MAX_TTL_MS", 60_000)
# Requests per second and burst per principal and serving process; 0 turns the limit off.
KVSP_RATE_LIMIT_PER_S = _float_setting("KVSP_RATE_LIMIT_PER_S", 2000.0)
KVSP_RATE_LIMIT_BURST = _int_setting("KVSP_RATE_LIMIT_BURST", 4000)
# Refused bearer tokens per second and burst per client address and serving process: past them
# an address's tokens are answered 429 before they are looked up, except tokens the process has
# verified before (common/throttling.py); 0 turns the limit off.
KVSP_AUTH_FAILURES_PER_S = _float_setting("KVSP_AUTH_FAILURES_PER_S", 5.0)
KVSP_AUTH_FAILURES_BURST = _int_setting("KVSP_AUTH_FAILURES_BURST", 50)
# Proxies in front of the servers whose X-Forwarded-For names the client (0: the field is
# ignored and the client is the peer's address, so that a client cannot choose its own).
KVSP_TRUSTED_PROXIES = _int_setting("KVSP_TRUSTED_PROXIES", 0)
# How long a node's block and lease requests take a verified bearer token as it was: a revoked
# token may serve them for this long in each process (0: verified on every request).
KVSP_AUTH_CACHE_S = _float_setting("KVSP_AUTH_CACHE_S", 2.0)
# The longest life of a delegated token (POST CP tokens, DESIGN.md section 6).
KVSP_DELEGATED_TTL_MS = _int_setting("KVSP_DELEGATED_TTL_MS", 60_000)
if KVSP_DELEGATED_TTL_MS < 1:
    raise ImproperlyConfigured("KVSP_DELEGATED_TTL_MS must be at least 1")
KVSP_MAX_LOOKUP_KEYS = _int_setting("KVSP_MAX_LOOKUP_KEYS", 65_536)
KVSP_MAX_BATCH_RECORDS = _int_setting("KVSP_MAX_BATCH_RECORDS", 4096)
# Blocks one batch GET (POST blocks/{compat}/{scope}) may ask a holder for.
KVSP_MAX_BATCH_BLOCKS = _int_setting("KVSP_MAX_BATCH_BLOCKS", 256)
KVSP_MAX_BLOCK_OCTETS = _int_setting("KVSP_MAX_BLOCK_OCTETS", 1024**3)
KVSP_PREFETCH_DEADLINE_MS = _int_setting("KVSP_PREFETCH_DEADLINE_MS", 5_000)
KVSP_PREFETCH_LEASE_MS = _int_setting("KVSP_PREFETCH_LEASE_MS", 30_000)

# Placement Controller policy (placement/policy.py).
KVSP_SLEEP_MIN_ACTIVE = _int_setting("KVSP_SLEEP_MIN_ACTIVE", 1)
KVSP_SLEEP_MAX_RUNNING = _int_setting("KVSP_SLEEP_MAX_RUNNING", 0)
KVSP_PLACEMENT_MAX_KV_UTILIZATION = _float_setting("KVSP_PLACEMENT_MAX_KV_UTILIZATION", 0.95)
KVSP_PLACEMENT_MAX_QUEUE_FACTOR = _float_setting("KVSP_PLACEMENT_MAX_QUEUE_FACTOR", 2.0)
KVSP_PLACEMENT_MAX_COST_US = _float_setting("KVSP_PLACEMENT_MAX_COST_US", 0.0)
KVSP_MEAN_OUTPUT_TOKENS = _int_setting("KVSP_MEAN_OUTPUT_TOKENS", 256)
KVSP_STATUS_SAMPLE_S = _int_setting("KVSP_STATUS_SAMPLE_S", 10)
KVSP_FAILURE_CHECK_S = _float_setting("KVSP_FAILURE_CHECK_S", 1.0)
KVSP_DIRECTIVE_POLL_S = _float_setting("KVSP_DIRECTIVE_POLL_S", 0.2)
# Directives are POSTed at once by the process that records them (placement/delivery.py):
# threads per process, and how long one attempt may take before the Celery task retries it.
KVSP_DIRECTIVE_SENDERS = _int_setting("KVSP_DIRECTIVE_SENDERS", 4)
KVSP_DIRECTIVE_SEND_TIMEOUT_S = _float_setting("KVSP_DIRECTIVE_SEND_TIMEOUT_S", 2.0)
# Failure detection pacing (placement.services.do_mark_expired).
KVSP_FAILOVER_MAX_PER_CHECK = _int_setting("KVSP_FAILOVER_MAX_PER_CHECK", 10)
KVSP_FAILOVER_CUT_OFF_FRACTION = _float_setting("KVSP_FAILOVER_CUT_OFF_FRACTION", 0.55)
KVSP_FAILOVER_MIN_FLEET = _int_setting("KVSP_FAILOVER_MIN_FLEET", 3)
# How long a resume that was sent has to be answered before the sweep sends it again
# (sessions.tasks.retry_stalled): longer than one attempt takes.
KVSP_RESUME_RESEND_S = _float_setting("KVSP_RESUME_RESEND_S", 15.0)

# The control plane's server (kvspsite/asgi.py): threads per process that answer requests.
KVSP_HTTP_THREADS = max(_int_setting("KVSP_HTTP_THREADS", 4), 1)
# Output event streams (sessions/streams.py): a comment frame this often, so that a client that
# left is noticed and an idle connection is not cut by a proxy; streams open at once per
# principal across the control plane's processes (0: no limit).
KVSP_STREAM_HEARTBEAT_S = max(_float_setting("KVSP_STREAM_HEARTBEAT_S", 5.0), 0.1)
KVSP_STREAMS_PER_PRINCIPAL = _int_setting("KVSP_STREAMS_PER_PRINCIPAL", 100)

# Node role.
KVSP_INSTANCE = env.str("KVSP_INSTANCE", default="")
KVSP_PUBLIC_URL = env.str("KVSP_PUBLIC_URL", default="")
KVSP_CONTROL_URL = env.str("KVSP_CONTROL_URL", default="")
KVSP_TOKEN = env.str("KVSP_TOKEN", default="")
KVSP_TIER_DEVICE_OCTETS = _int_setting("KVSP_TIER_DEVICE_OCTETS", 1024**3)
KVSP_TIER_HOST_OCTETS = _int_setting("KVSP_TIER_HOST_OCTETS", 4 * 1024**3)
KVSP_TIER_DISK_OCTETS = _int_setting("KVSP_TIER_DISK_OCTETS", 16 * 1024**3)
# What each scope keeps on the node against another scope's stores (workers.eviction); 0 makes
# it an equal share of host and disk among the scopes holding blocks there.
KVSP_SCOPE_QUOTA_OCTETS = _int_setting("KVSP_SCOPE_QUOTA_OCTETS", 0)
KVSP_DISK_DIR = Path(env.str("KVSP_DISK_DIR", default=str(VAR_DIR / "disk")))
KVSP_STATUS_TTL_MS = _int_setting("KVSP_STATUS_TTL_MS", 3_000)
# How stale a block's last access may be before a GET refreshes it (the LRU order of eviction,
# workers.selectors): the order is kept to this resolution without a write per GET.
KVSP_ACCESS_RESOLUTION_MS = max(_int_setting("KVSP_ACCESS_RESOLUTION_MS", 1_000), 0)
# The host tier: shared-memory files the node's HTTP process serves without a copy.
_SHM = Path("/dev/shm")  # noqa: S108 - the host tier is shared memory by design
KVSP_SHM_DIR = Path(
    env.str("KVSP_SHM_DIR", default=str(_SHM / "kvsp" if _SHM.is_dir() else VAR_DIR / "shm"))
)
# The rates at which the node reads its storage tiers, reported as "read_mbit_per_s" (4.4).
KVSP_TIER_HOST_READ_MBIT_PER_S = _int_setting("KVSP_TIER_HOST_READ_MBIT_PER_S", 200_000)
KVSP_TIER_DISK_READ_MBIT_PER_S = _int_setting("KVSP_TIER_DISK_READ_MBIT_PER_S", 16_000)
# The TTL a node asks for its Replica Records (the IS caps it at KVSP_MAX_TTL_MS).
KVSP_REPLICA_TTL_MS = _int_setting("KVSP_REPLICA_TTL_MS", 600_000)
# An engine's model directory; none makes the node a storage-only holder.
KVSP_MODEL_DIR = env.str("KVSP_MODEL_DIR", default="")
KVSP_BLOCK_TOKENS = _int_setting("KVSP_BLOCK_TOKENS", 16)
# Whether the worker runs its engine once, on a short prompt, before it reports that it serves
# (off: the node's first sessions pay for the engine's first run).
KVSP_ENGINE_WARM_UP = env.bool("KVSP_ENGINE_WARM_UP", default=True)
# Figures a node reports until its engine has measured its own (and always without one).
KVSP_BATCH_SIZE = _int_setting("KVSP_BATCH_SIZE", 32)
KVSP_PREFILL_TOKENS_PER_S = _int_setting("KVSP_PREFILL_TOKENS_PER_S", 10_000)
KVSP_DECODE_TOKENS_PER_S = _int_setting("KVSP_DECODE_TOKENS_PER_S", 1_000)
# Blocks of one prefetch directive loaded at the same time.
KVSP_PREFETCH_PARALLEL = _int_setting("KVSP_PREFETCH_PARALLEL", 4)
# With a non-deterministic sampler, output tokens released per acknowledged checkpoint (6.8).
KVSP_CHECKPOINT_TOKENS = _int_setting("KVSP_CHECKPOINT_TOKENS", 8)
# Holders (base URLs, comma-separated) that get a copy of every block a session's instance
# computes, so that the session's KV cache survives the whole node (6.8).
KVSP_SESSION_HOLDERS = tuple(env.list("KVSP_SESSION_HOLDERS", default=[]))


def _links_setting(name: str) -> tuple:
    """Configured links (4.4 Instance Status Record) as a JSON array of
    ``{"holder", "mbit_per_s", "rtt_us"}``; measured links replace them per holder."""
    import json

    from kvsp.problems import ProtocolError
    from kvsp.records import Link

    raw = env.str(name, default="") or "[]"
    try:
        value = json.loads(raw)
        if not isinstance(value, list):
            raise ValueError("not an array")
        return tuple(Link.from_json(item) for item in value)
    except (ValueError, ProtocolError) as exc:
        raise ImproperlyConfigured(
            f"{name} must be a JSON array of links {{holder, mbit_per_s, rtt_us}}: {exc}"
        ) from None


KVSP_LINKS = _links_setting("KVSP_LINKS")

if KVSP_ROLE == "node":
    for _name in (
        "KVSP_PREFILL_TOKENS_PER_S",
        "KVSP_DECODE_TOKENS_PER_S",
        "KVSP_BLOCK_TOKENS",
        "KVSP_CHECKPOINT_TOKENS",
    ):
        if globals()[_name] < 1:
            raise ImproperlyConfigured(f"{_name} must be at least 1")
    from kvsp.records import base_url_rule_broken

    for _value in KVSP_SESSION_HOLDERS:
        if (_broken := base_url_rule_broken(_value)) is not None:
            raise ImproperlyConfigured(
                f"KVSP_SESSION_HOLDERS: {_value!r} is not an http(s) base URL ending with '/': "
                f"{_broken}"
            )
    for _name in ("KVSP_CONTROL_URL", "KVSP_PUBLIC_URL"):
        _value = globals()[_name]
        if _value and (_broken := base_url_rule_broken(_value)) is not None:
            raise ImproperlyConfigured(
                f"{_name}={_value!r} must be an http(s) base URL ending with '/': {_broken}"
            )
    # Without these a node would start and then refuse every store and report (6.3, 6.7).
    for _name in ("KVSP_INSTANCE", "KVSP_PUBLIC_URL", "KVSP_CONTROL_URL", "KVSP_TOKEN"):
        if not globals()[_name]:
            raise ImproperlyConfigured(f"{_name} must be set when KVSP_ROLE is node")

# --- Celery -----------------------------------------------------------------------------------

CELERY_BROKER_URL = _url_setting(
    "CELERY_BROKER_URL",
    "filesystem://",
    ("filesystem", "redis", "rediss", "amqp", "amqps", "memory"),
)
CELERY_RESULT_BACKEND = env.str(
    "CELERY_RESULT_BACKEND",
    default=(
        CELERY_BROKER_URL
        if CELERY_BROKER_URL.startswith(("redis://", "rediss://"))
        else f"file://{VAR_DIR / 'celery' / 'results'}"
    ),
)
CELERY_BROKER_TRANSPORT_OPTIONS = {}
if CELERY_BROKER_URL.startswith("filesystem://"):
    CELERY_BROKER_TRANSPORT = "kvspsite.broker:Transport"
    _broker_dir = VAR_DIR / "celery" / "broker"
    for _sub in ("queue", "processed", "control"):
        (_broker_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "processed_folder": str(_broker_dir / "processed"),
        "control_folder": str(_broker_dir / "control"),
        # kombu reads the folder once a second by default: every hop of a request (a
        # placement's directive, a generate, a resume) would wait for it. A listing of a small
        # folder costs microseconds.
        "polling_interval": _float_setting("KVSP_BROKER_POLL_S", 0.02),
        "store_processed": False,
    }
if CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
    # Tasks acknowledge late: a message whose worker died goes back to its queue once it has
    # been unacknowledged for the visibility timeout. That must outlast the longest task (or a
    # running task is delivered twice; tasks are idempotent, so only work is wasted), and it
    # bounds how long a dead worker's task waits for another.
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "visibility_timeout": _int_setting("KVSP_BROKER_VISIBILITY_TIMEOUT_S", 900),
        "unacked_restore_interval": _int_setting("KVSP_BROKER_RESTORE_INTERVAL_S", 10),
        "unacked_restore_throttle": 1,
        # A broker that vanishes without closing the connection (a restart, a failover) is
        # noticed instead of waited on forever.
        "socket_timeout": 10,
        "socket_connect_timeout": 5,
        "health_check_interval": 10,
    }
    CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"socket_timeout": 10, "socket_connect_timeout": 5}
if CELERY_RESULT_BACKEND.startswith("file://"):
    Path(CELERY_RESULT_BACKEND.removeprefix("file://")).mkdir(parents=True, exist_ok=True)

# --- REST framework -----------------------------------------------------------------------------

REST_FRAMEWORK = {
    "DEFAULT_RENDERER_CLASSES": [
        "common.api.KvspJSONRenderer",
        "common.api.PlainJSONRenderer",
    ],
    "DEFAULT_PARSER_CLASSES": ["common.api.KvspJSONParser", "common.api.PlainJSONParser"],
    "DEFAULT_AUTHENTICATION_CLASSES": ["index.authentication.BearerTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "EXCEPTION_HANDLER": "common.api.problem_exception_handler",
    "DEFAULT_THROTTLE_CLASSES": ["common.throttling.PrincipalRateThrottle"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "KVSP — KV Cache Storage Protocol",
    "DESCRIPTION": "Index Service, Placement Controller and node endpoints of KVSP.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "common.openapi.describe",
    ],
    "DISABLE_ERRORS_AND_WARNINGS": True,
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("KVSP_LOG_LEVEL", default="INFO")},
    # httpx logs every request at INFO: a loader's hundreds a second would cost more than
    # they tell.
    "loggers": {"django.request": {"level": "ERROR"}, "httpx": {"level": "WARNING"}},
}
