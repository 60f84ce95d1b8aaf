"""The tuning database: models, one-file storage, and the layered lookup dispatch uses."""

from .layers import Choice, Resolver, TuningDatabaseWarning, default_user_db, shipped_dbs
from .models import SCHEMA_VERSION, Record
from .provenance import provenance
from .storage import DatabaseError, TuningDB, record_dict

__all__ = [
    "SCHEMA_VERSION", "Choice", "DatabaseError", "Record", "Resolver", "TuningDB",
    "TuningDatabaseWarning", "default_user_db", "provenance", "record_dict",
    "shipped_dbs",
]
