"""A node's shipped copy of a model directory: taken again when the driver's directory has a file
the copy lacks (or one of another size), replaced whole."""

from __future__ import annotations

from actors.model_copy import replace_dir, stale


def test_a_copy_lacking_a_file_of_the_drivers_directory_is_stale(tmp_path):
    dest = tmp_path / "copy"
    dest.mkdir()
    (dest / "model.safetensors").write_bytes(b"w" * 10)
    (dest / "config.json").write_text("{}")
    manifest = {"model.safetensors": [10, "x"], "config.json": [2, "y"]}
    assert not stale(manifest, dest)
    assert stale({**manifest, "ggml-vocab.gguf": [5, "z"]}, dest)  # the directory gained a file
    assert stale({**manifest, "config.json": [3, "y"]}, dest)  # one of another size


def test_replace_dir_swaps_a_stale_copy_for_the_new_one(tmp_path):
    dest, new = tmp_path / "copy", tmp_path / "new"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    new.mkdir()
    (new / "ggml-vocab.gguf").write_text("vocab")
    replace_dir(new, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["ggml-vocab.gguf"] and not new.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["copy"]  # nothing left aside
