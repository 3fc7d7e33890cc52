"""User-chosen names are data, never paths: the one place that turns a tensor or prefix name into a file name.

`file_name` is injective (a SHA-256 of the UTF-8 name decides it; the readable part only helps a person
browsing the folder) and can form neither `.`, `..`, a separator nor a component longer than
MAX_FILE_NAME_CHARS, whatever the name holds. The real name lives inside the files' manifest, which is what
a restore reads.
"""

from __future__ import annotations

import hashlib
import re

READABLE_CHARS = 40  # of the name, kept in the file name for people browsing the folder
HASH_CHARS = 32  # hex digits of the name's SHA-256: 128 bits
MAX_FILE_NAME_CHARS = len("t-") + READABLE_CHARS + len("-") + HASH_CHARS
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def file_name(name: str) -> str:
    """The file (or folder) name that stands for `name`: "t-READABLE-HASH", ASCII letters, digits, '_' and
    '-' only."""
    readable = _UNSAFE.sub("_", name)[:READABLE_CHARS]
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_CHARS]
    return f"t-{readable}-{digest}"
