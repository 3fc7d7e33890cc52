"""PostgreSQL URLs as catalog locations: knowing one, and printing one without its password."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

POSTGRES_SCHEMES = ("postgresql", "postgres")


def is_postgres_url(location: str) -> bool:
    """Whether `location` is a PostgreSQL URL (postgresql://... or postgres://...)."""
    return location.partition("://")[0].lower() in POSTGRES_SCHEMES and "://" in location


def redacted(location: str) -> str:
    """`location` fit to print: a URL without its password (in the user part or a password= parameter)."""
    if "://" not in location:
        return location
    parts = urlsplit(location)
    user, at, hosts = parts.netloc.rpartition("@")
    netloc = f"{user.partition(':')[0]}{at}{hosts}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = parts.query
    if any(key == "password" for key, _ in pairs):
        query = urlencode([(key, value) for key, value in pairs if key != "password"], safe="/")
    tail = (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    return f"{parts.scheme}://{netloc}{parts.path}{tail}"  # urlunsplit drops an empty host's //
