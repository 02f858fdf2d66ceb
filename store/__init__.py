"""The warehouse: a directory of Parquet tables whose schema this package owns."""

from store.schema import SCHEMA_VERSION, TABLES
from store.warehouse import ShardWriter, Warehouse

__all__ = ["SCHEMA_VERSION", "TABLES", "ShardWriter", "Warehouse"]
