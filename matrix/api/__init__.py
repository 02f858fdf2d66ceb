"""The Python API under the `matrix` command: each verb of the CLI parses its arguments, calls one of
these, and prints what it returns.

    from matrix import api

    result = api.run("configs/smoke.yaml", "warehouse", executor="local")   # -> RunResult
    api.analyze("warehouse")                                                 # -> AnalyzeResult
    con = api.connect("warehouse")                                           # DuckDB with the views
    con.sql("SELECT cell_id, kld_mean, top1_agreement FROM summary").df()
    api.sql("warehouse", "SELECT count(*) AS n FROM cells").to_dict()       # -> QueryResult
    job = api.kld("ref.gguf", ["q4_k_m.gguf"], "wiki.test.raw", "kld-wh")    # -> KldResult
    api.stacks("warehouse"), api.status("warehouse")                         # -> StacksResult, StatusResult
    api.verify("warehouse"), api.card("warehouse", "llamacpp/q4_k_m")        # -> VerifyResult, CardResult

Bad input raises common.errors.UserError with one line naming the file, field and value; a cell's
failure is the cell's own and is reported in the result. Progress goes to `log` (default: stderr).
docs/python-api.md has a notebook example.
"""

from matrix.api.analysis import analyze, connect, sql
from matrix.api.kld import kld
from matrix.api.results import AnalyzeResult, CandidateResult, KldResult, QueryResult, RunResult
from matrix.api.sweep import run
from matrix.api.warehouse import CardResult, StacksResult, StatusResult, VerifyResult, card, stacks, status, verify

__all__ = [
    "AnalyzeResult",
    "CandidateResult",
    "CardResult",
    "KldResult",
    "QueryResult",
    "RunResult",
    "StacksResult",
    "StatusResult",
    "VerifyResult",
    "analyze",
    "card",
    "connect",
    "kld",
    "run",
    "sql",
    "stacks",
    "status",
    "verify",
]
