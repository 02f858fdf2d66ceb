"""What a spec holds and expands to: parsing and validation, cells, candidates, calibration, corpus, models."""
