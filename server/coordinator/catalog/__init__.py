"""The coordinator's catalog: the records it keeps (records.py), their documents (documents.py), the
`Catalog` interface (interface.py) and its SQLite implementation (sqlite.py, sqlite_schema.py).
"""
