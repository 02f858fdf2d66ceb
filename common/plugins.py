"""Where the plug-ins (extras/) reach the layers below them. The extras package sits above store and
analysis, which never import it: importing it installs `provider` here (every driver path imports
it), and store.schema and analysis.sql read their part through it.

    views()    {view: (SQL, what it answers)}: created after the core's views (analysis.sql)
    columns()  [(name, pyarrow type)]: the cells table's columns a plug-in records (store.schema)
    tables()   {name: pyarrow schema}: a plug-in's own tables, e.g. its graded metrics (store.schema)
    name_words(cell_row)  its words in a stack's readable name (analysis/stack_names.py)
"""

from __future__ import annotations


class Provider:
    """What a process knows of the plug-ins before the extras package is imported: nothing."""

    installed = False

    def views(self) -> dict[str, tuple[str, str]]:
        return {}

    def columns(self) -> list[tuple[str, object]]:
        return []

    def tables(self) -> dict[str, object]:
        return {}

    def name_words(self, cell_row: dict) -> list[str]:
        return []


provider = Provider()
