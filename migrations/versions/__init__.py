"""Migration scripts, one revision per file, applied in order by Alembic."""
