"""$MAML_CACHE_DIR: when set, the decoded Omniglot cache goes there and never into the data folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import helpers
import pytest

import tasks

ARCHIVE = "images_background_small1.zip"  # the smaller real archive: one is enough to decode and cache


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A writable data folder holding a copy of a real archive (the shared data is never written)."""
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy2(helpers.omniglot_root() / ARCHIVE, folder / ARCHIVE)
    # The fallback of the fallback: keep the user's own ~/.cache out of reach whatever happens.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return folder


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_the_cache_goes_to_maml_cache_dir_not_into_a_writable_data_folder(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "env-cache"))
    cold = tasks.Omniglot(data, rotations=False)
    assert not cold.from_cache and cold.cache_path is not None
    assert cold.cache_path.parent == tmp_path / "env-cache" and cold.cache_path.is_file()
    assert files_under(data) == [ARCHIVE]  # no .maml-cache/ beside the data
    warm = tasks.Omniglot(data, rotations=False)
    assert warm.from_cache and warm.cache_path == cold.cache_path
    assert files_under(data) == [ARCHIVE]
    assert not (tmp_path / "xdg-cache").exists()


def test_an_unwritable_maml_cache_dir_warns_and_still_leaves_the_data_folder_alone(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("the cache folder would have to go below this file")
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    with pytest.warns(RuntimeWarning, match="could not write the decoded Omniglot cache"):
        omni = tasks.Omniglot(data, rotations=False)
    assert omni.cache_path is None and files_under(data) == [ARCHIVE]


def test_cache_dir_beats_the_variable_and_without_either_the_cache_sits_next_to_the_data(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MAML_CACHE_DIR", str(tmp_path / "env-cache"))
    explicit = tasks.Omniglot(data, rotations=False, cache_dir=tmp_path / "explicit")
    assert explicit.cache_path is not None and explicit.cache_path.parent == tmp_path / "explicit"
    assert not (tmp_path / "env-cache").exists()
    monkeypatch.delenv("MAML_CACHE_DIR")
    default = tasks.Omniglot(data, rotations=False)
    assert default.cache_path is not None and default.cache_path.parent == data / ".maml-cache"
