"""The sweep's axes, by name. The values an engine, dtype, attention or device axis takes are
what the registered engines declare (backends/__init__.py), not listed here."""

# Keys of one cell (singular), as used in include / exclude / reference.
CELL_AXES = ("model", "engine", "dtype", "attention", "tp", "device")
# Spec key (plural where the design card says so) -> cell key.
SPEC_AXES = {
    "models": "model",
    "engines": "engine",
    "dtypes": "dtype",
    "attention": "attention",
    "tp": "tp",
    "devices": "device",
}
