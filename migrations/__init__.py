"""Alembic environment and versions of the audit database: the only way its schema is made or changed.

`proxy.audit.schema` finds this folder through `migrations.__file__`, so migrations run from an installed
wheel without an alembic.ini.
"""
