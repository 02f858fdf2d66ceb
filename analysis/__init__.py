"""Analysis over the warehouse (DuckDB). Never imports a backend."""
