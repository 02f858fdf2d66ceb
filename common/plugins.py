"""Where the plug-ins (extras/) reach the layers below them. The extras package sits above store and
analysis, which never import it: importing it installs `provider` here (the CLI and `matrix.api`
do; a script that writes cells rows imports it too, or its rows lack the plug-ins' columns), and
store.schema and analysis read their part through it.

    views()    {view: (SQL, what it answers)}: created after the core's views (analysis.sql)
    columns()  [(name, pyarrow type)]: the cells table's columns a plug-in records (store.schema)
    tables()   {name: pyarrow schema}: a plug-in's own tables, e.g. its graded metrics (store.schema)
    name_words(cell_row)  its words in a stack's readable name (analysis/stack_names.py)
    option_word(key, value)  an engine option's value in one word, for the same names (None: not a plug-in's)
    disclosures(cell_row, ref_row)  its entries of a card's disclosure (analysis/disclosure.py)
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

    def option_word(self, key: str, value) -> str | None:
        return None

    def disclosures(self, cell_row: dict, ref_row: dict) -> dict:
        return {}


provider = Provider()
