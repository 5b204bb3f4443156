"""PostgreSQL URLs: telling one, hiding its password, and taking out the ``schema`` parameter."""

from __future__ import annotations

import re
import urllib.parse

__all__ = ["is_postgres_url", "passwords", "redact", "split_schema"]

_SCHEMES = ("postgresql://", "postgres://")
_CONNINFO_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)")


def is_postgres_url(location: str) -> bool:
    """Whether ``location`` is a PostgreSQL URL (``postgresql://`` or ``postgres://``)."""
    return location.startswith(_SCHEMES)


def redact(url: str) -> str:
    """``url`` with its password (in the user part or a ``password`` parameter) hidden."""
    if not is_postgres_url(url):  # a libpq key=value string
        return _CONNINFO_PASSWORD.sub(r"\1***", url)
    scheme, _, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"
    path, question, query = tail.partition("?")
    if question:
        kept = [
            part if _query_key(part) != "password" else "password=***" for part in query.split("&")
        ]
        tail = f"{path}?{'&'.join(kept)}"
    return f"{scheme}://{netloc}{slash}{tail}"


def passwords(url: str) -> tuple[str, ...]:
    """The passwords written in ``url`` (as written and decoded), to keep out of messages."""
    found: list[str] = []
    if not is_postgres_url(url):  # a libpq key=value string
        for match in _CONNINFO_PASSWORD.finditer(url):
            value = match.group(2)
            found.append(value)
            if value.startswith("'"):
                found.append(value[1:-1].replace("\\'", "'").replace("\\\\", "\\"))
    else:
        netloc = url.partition("://")[2].partition("/")[0].partition("?")[0]
        userinfo, at, _ = netloc.rpartition("@")
        if at and ":" in userinfo:
            found.append(userinfo.split(":", 1)[1])
        query = url.partition("?")[2].partition("#")[0]
        found += [
            part.partition("=")[2] for part in query.split("&") if _query_key(part) == "password"
        ]
    decoded = [urllib.parse.unquote_plus(secret) for secret in found]
    # Shorter ones would blot out ordinary words of a message; libpq never quotes a password.
    return tuple(sorted({s for s in (*found, *decoded) if len(s) >= 4}, key=len, reverse=True))


def _query_key(part: str) -> str:
    return urllib.parse.unquote_plus(part.partition("=")[0])


def split_schema(url: str) -> tuple[str, str | None]:
    """Take the ``schema`` parameter out of a URL's query (psycopg does not know it)."""
    if not is_postgres_url(url):
        return url, None
    head, question, rest = url.partition("?")
    if not question:
        return url, None
    query, hash_mark, fragment = rest.partition("#")
    schema = None
    kept = []
    for part in query.split("&"):
        if _query_key(part) == "schema":
            schema = urllib.parse.unquote_plus(part.partition("=")[2])
        elif part:
            kept.append(part)
    rebuilt = head + ("?" + "&".join(kept) if kept else "") + hash_mark + fragment
    return rebuilt, schema
