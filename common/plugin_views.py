"""Where the plug-ins' SQL views reach analysis: the extras package, which sits above analysis and is
never imported by it, installs `provider` when it is imported (every driver path imports it);
analysis.sql calls it to create them after the core's views. {view: (SQL, what it answers)}."""

from __future__ import annotations

from typing import Callable

provider: Callable[[], dict[str, tuple[str, str]]] = dict
