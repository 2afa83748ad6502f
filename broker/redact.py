"""Masking credentials: a URL's password never reaches a log line, an exception or a terminal.

One function for every URL kvflow prints (AMQP and database alike) and its text
variant for messages that may quote a URL or its password (a driver's error text).
It lives in `broker` because both packages need it and `broker` never imports `worker`.
"""

from __future__ import annotations

import re
import urllib.parse

MASK = "***"
# For text that urlsplit cannot take apart: mask what sits between "user:" and "@".
_USERINFO = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")


def _password(url: str) -> str | None:
    try:
        return urllib.parse.urlsplit(url).password
    except ValueError:
        return None


def redact_url(url: object) -> str:
    """`url` (a string, or anything whose str() is one) with its password replaced by ***."""
    text = str(url)
    try:
        parts = urllib.parse.urlsplit(text)
        password = parts.password
        host, port = parts.hostname or "", parts.port
    except ValueError:  # a bad port or bracket: fall back to the pattern
        return _USERINFO.sub(rf"\1{MASK}@", text)
    if not password:
        return _USERINFO.sub(rf"\1{MASK}@", text)
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username or ''}:{MASK}@{host}"
    if port is not None:
        netloc += f":{port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def redact_text(text: str, url: object) -> str:
    """`text` with every occurrence of `url`, and of its password (as written in the URL,
    decoded, or re-encoded), masked."""
    raw = str(url)
    text = text.replace(raw, redact_url(raw))
    password = _password(raw)
    if password:
        decoded = urllib.parse.unquote(password)
        forms = {password, decoded, urllib.parse.quote(decoded, safe="")}
        for form in sorted(forms, key=len, reverse=True):  # longest first: no partial masks
            text = text.replace(form, MASK)
    return text
