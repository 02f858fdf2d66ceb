"""`options: {cpu_path: [native, scalar, avx2, avx512]}`: the CPU code path a cell's engine runs,
an engine option graded against a partner cell, the same stack on the reference hardware: the
device and path of the spec's `reference:` (default: the CPU's native path, what the libraries pick).

An AVX2-only server, an AVX-512 server and an AMX server run different kernels for the same stack;
each library lets a user pick its code path (common/cpu_paths.py names the switches), so one
machine measures the drift between those kinds of CPU. `offered` is every path this CPU can run. A
path the CPU lacks the instructions for, or a name that is no path, is the spec's error. The engine
sets the switches where it starts the cell's process (HF: backends/hf_cpu_path.py) and its hook
`cpu_path_ran` reads back what ran, failing the cell where a library fell back to another path;
an engine without the hook takes no option cpu_path and skips the cell, saying so. Each cell off
the reference hardware is measured row by row against the same stack on the reference hardware into
hardware_metrics, and so is each cell on another device (a GPU's, captured in the same run or merged
in from its own warehouse); the hardware_drift view sums it (analysis/hardware_drift.py).
"""

from __future__ import annotations

from typing import Any

from common import cpu_paths
from extras import PartnerGraded


class CpuPathOption(PartnerGraded):
    key = "cpu_path"
    grading = "analysis.hardware_drift"
    partner_about = (
        "the stack id of the same stack on the reference hardware (the reference's device and CPU code path), "
        "what hardware_drift compares it with"
    )
    option = True
    title = "CPU code path"
    hook = "cpu_path_ran"
    missing = "engine {engine} offers no CPU code path switch (the cell asks for {key})"
    allowed = cpu_paths.NAMES
    default = cpu_paths.NATIVE
    plain_default = True  # native sets no switch: the plain cell
    table = None
    rank = 75
    about = (
        "the CPU code path the engine runs: native (what the libraries pick), scalar, avx2, avx512, "
        "avx512_bf16, amx, or offered (every path this CPU runs); graded against the reference's path"
    )
    json_schema = {"enum": [*cpu_paths.NAMES, cpu_paths.OFFERED]}

    def parse(self, value: Any, fail) -> str | list[str]:
        if value == cpu_paths.OFFERED:  # an axis of every path this CPU runs
            return cpu_paths.offered(cpu_paths.cpu_flags())
        if value not in cpu_paths.NAMES:
            raise fail(f"unknown CPU code path; expected one of {', '.join(cpu_paths.NAMES)} or offered", value)
        lacks = cpu_paths.lacks(value, cpu_paths.cpu_flags())
        if lacks:
            raise fail(f"this CPU cannot run CPU code path {value}: it lacks {', '.join(lacks)}", value)
        return value

    def partner(self, value: Any) -> None:
        return None  # the partner is the reference hardware's stack, whatever the value (partner_elsewhere)

    def partner_elsewhere(self, combo: dict, opts: dict, reference: dict) -> tuple[dict, dict] | None:
        """The same stack on the reference hardware: the device and path the spec's `reference:` names
        (default: the CPU's native path), for every cell on other hardware, a path's or another
        device's (a GPU's, merged in from its own warehouse). None for a cell on the reference
        hardware, or of an engine that cannot run there."""
        from backends import backend_class

        cls = backend_class(combo.get("engine", ""))
        device, path = reference.get("device", "cpu"), reference.get(self.key, cpu_paths.NATIVE)
        if cls is None or device not in cls.devices:
            return None
        if path != cpu_paths.NATIVE and self.key not in getattr(cls, "options", ()):
            path = cpu_paths.NATIVE  # an engine with no path switch: its plain stack on that device
        if (combo.get("device", "cpu"), opts.get(self.key, cpu_paths.NATIVE)) == (device, path):
            return None
        theirs = {k: v for k, v in opts.items() if k != self.key}
        return {**combo, "device": device}, ({**theirs, self.key: path} if path != cpu_paths.NATIVE else theirs)

    def node_refusal(self, value: Any, node: dict) -> str | None:
        lacks = cpu_paths.lacks(value, frozenset(node.get("cpu_flags") or ()))
        return f"{node.get('host') or node.get('node_id')} lacks {', '.join(lacks)}" if lacks else None

    def unsupported(self, engine_cls, cell, value) -> str | None:
        # an engine without the option skips the cell as for any option it does not take
        if value != cpu_paths.NATIVE and cell.device != "cpu":
            return f"CPU code path {value}: it runs on device cpu, and this cell runs on {cell.device}"
        refused = getattr(engine_cls, "cpu_path_refusal", None)  # an engine's own limits (llama.cpp's AMX)
        why = refused(value) if refused is not None and value != cpu_paths.NATIVE else None
        return f"CPU code path {value}: {why}" if why else None

    # the capture: what ran, read back in the host (the engine raises where it fell back)
    def settings(self, backend, value: Any) -> dict[str, Any]:
        return {} if value == cpu_paths.NATIVE else backend.cpu_path_ran()

    # analysis: the pairs' rows (PartnerGraded), and their layer states where both sides recorded them
    def tables(self) -> dict[str, Any]:
        from analysis.hardware_drift import LAYER_TABLE
        from store.schema import LAYER_METRICS

        return {**super().tables(), LAYER_TABLE: LAYER_METRICS}

    def analyze(self, wh, done, reference, force, log, skip_damaged: bool = False) -> dict | None:
        from analysis.hardware_drift import analyze_layers

        got = super().analyze(wh, done, reference, force, log, skip_damaged)
        layered = analyze_layers(wh, done, force, log, skip_damaged)  # also drops the pairs no longer there
        return None if got is None else {**got, "layers": layered}

    # the report (the cells column, views and card: PartnerGraded, from analysis/hardware_drift.py)
    def model_report(self, data: dict, model: str, k: int) -> str:
        from analysis.report_hardware import section

        return section(data, model, k)

    def name_words(self, cell_row: dict) -> list[str]:
        path = _ran(cell_row).get("cpu_path")
        return [f"cpu-{path}"] if path else []

    def disclose(self, cell_row: dict, ref_row: dict) -> dict:
        """Both stacks' CPU code paths where either ran one other than native."""
        mine, theirs = _ran(cell_row), _ran(ref_row)
        if not mine and not theirs:
            return {}

        def say(ran: dict) -> str:
            if not ran:
                return cpu_paths.NATIVE
            if ran.get("ggml_cpu_variant"):
                return f"{ran['cpu_path']} (ggml's {ran['ggml_cpu_variant']} CPU backend)"
            isa = ran.get("onednn_isa") or "no bf16 primitive"
            return f"{ran['cpu_path']} (torch {ran.get('cpu_capability')}, oneDNN {isa})"

        return {"cpu_path": {"candidate": say(mine), "reference": say(theirs)}}


def _ran(cell_row: dict) -> dict:
    """The CPU code path a cells row's settings record ({}: native, or an engine that records none)."""
    from extras import loads

    raw = cell_row.get("settings")
    settings = loads(raw) if isinstance(raw, str) else (raw or {})
    return settings if settings.get("cpu_path") else {}


EXTRA = CpuPathOption
