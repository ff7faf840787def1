"""Keep secrets off terminals and out of logs: passwords in URLs, DSNs, query strings and messages.

Everything stragglerscope prints about a service (the store URL that `run`,
`demo` and `trace` show, StoreError and BrokerError messages, log lines, the
CLI's one-line errors) goes through ``redact``::

    redact("clickhouse://admin:SuperSecret42@ch:9000/db")   # 'clickhouse://admin:***@ch:9000/db'
    redact("http://h/x?user=a&password=pw")                  # 'http://h/x?user=a&password=***'
    redact("sasl_plain_password='pw'")                        # "sasl_plain_password='***'"

Secrets that arrive in other ways (``STRAGGLERSCOPE_STORE_PASSWORD``, the file
named by ``store.password_file``) are registered with ``add_secret`` when they
are read, and then hidden wherever they appear, whatever the text around them.

``install_log_filter`` puts a ``RedactingFilter`` on the root logger's
handlers; ``quiet_libraries`` keeps the client libraries' own connection-failure
logs (clickhouse_driver, kafka; often with a traceback) off the terminal: the
command reports the failure itself, in one line.
"""
from __future__ import annotations

import logging
import re
import threading
from urllib.parse import quote

MASK = "***"

# scheme://user:PASSWORD@host... : the password runs to the last '@' before the host part.
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@'\"]*:)(?P<pw>[^\s/'\"]*)@")

# user:PASSWORD@host without a scheme (DSNs, libraries' own messages).
_BARE_USERINFO = re.compile(r"(?P<head>(?<![\w/:.@-])[A-Za-z0-9_][A-Za-z0-9_.-]*:)(?P<pw>[^\s:/@'\"]+)@(?=[A-Za-z0-9\[])")

# Keys whose value is a secret, as a query parameter, key=value, key: value, or a dict/JSON entry.
# ``password_file`` and the like name where a secret is, not the secret: they are left alone.
_SECRET_KEYS = r"(?:password|passwd|pwd|secret|token|api_?key|access_?key|secret_?key|sasl_plain_password|jaas\.config)"
_KEY_VALUE = re.compile(
    r"(?P<key>(?<![A-Za-z0-9])(?:[A-Za-z0-9]*[_.-])*" + _SECRET_KEYS + r")(?![A-Za-z0-9_])"
    r"(?P<sep>['\"]?\s*[=:]\s*)"
    r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s&,;'\")}\]]+)",
    re.IGNORECASE)

_secrets: set[str] = set()
_lock = threading.Lock()
_MIN_SECRET_LEN = 4  # shorter values would mask ordinary words and numbers


def add_secret(value: str | None) -> None:
    """Hide ``value`` (and its URL-encoded form) wherever it appears in redacted text from now on."""
    if not value or len(value) < _MIN_SECRET_LEN:
        return
    with _lock:
        _secrets.add(value)
        _secrets.add(quote(value, safe=""))


def redact(text: object) -> str:
    """``text`` with every password it shows replaced by ``***``."""
    s = str(text)
    if not s:
        return s
    s = _USERINFO.sub(lambda m: m["head"] + (MASK if m["pw"] else "") + "@", s)
    s = _BARE_USERINFO.sub(lambda m: m["head"] + MASK + "@", s)
    s = _KEY_VALUE.sub(_mask_value, s)
    if _secrets:
        with _lock:
            known = sorted(_secrets, key=len, reverse=True)
        for secret in known:
            if secret in s:
                s = s.replace(secret, MASK)
    return s


def _mask_value(m: re.Match) -> str:
    value = m["value"]
    if value[:1] in "'\"" and value[-1:] == value[:1] and len(value) >= 2:
        masked = value[0] + MASK + value[0]
    else:
        masked = MASK
    if value.strip("'\"") in ("", MASK, "None", "null"):
        masked = value  # nothing secret to hide
    return m["key"] + m["sep"] + masked


def redact_url(url: str) -> str:
    """A URL fit to print: its password (userinfo or query parameter) replaced by ``***``."""
    return redact(url)


class RedactingFilter(logging.Filter):
    """Redacts a record's message and its traceback before any handler formats them.

    The traceback is formatted here, redacted, and kept as ``exc_text`` (the
    text formatter appends it) and ``exc`` (the JSON formatter of
    ``core.logs`` writes extra fields as they are).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_redacted", False):
            return True
        try:
            msg = record.getMessage()
        except Exception:  # a bad format string: leave it to the handler's own error path
            return True
        clean = redact(msg)
        if clean != msg or record.args:
            record.msg, record.args = clean, ()
        if record.exc_info:
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
            record.exc_text = redact(text)
            record.exc = record.exc_text
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        record._redacted = True
        return True


def install_log_filter(logger: logging.Logger | None = None) -> None:
    """Put one ``RedactingFilter`` on every handler of ``logger`` (default: the root logger)."""
    logger = logger or logging.getLogger()
    for handler in logger.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


# Client libraries that log (with tracebacks) every failed connection attempt on their own.
NOISY_LIBRARIES = ("clickhouse_driver", "kafka")


def quiet_libraries(verbose: bool = False) -> None:
    """Library connection logs only with ``-v`` (then at INFO, redacted); the command says what failed."""
    for name in NOISY_LIBRARIES:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.CRITICAL + 1)
