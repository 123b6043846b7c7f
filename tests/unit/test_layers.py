"""The folder a test file sits in decides its layer marker, and a file outside the layer folders
fails collection (tests/layers.py, tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.layers import LAYERS, MARKERS, MisplacedTestFile, layer_of, wrong_layer_markers

TESTS = Path(__file__).resolve().parents[1]
CONFTEST = TESTS / "conftest.py"


@pytest.mark.parametrize(
    ("folder", "marker"),
    [("unit", "unit"), ("process", "multiprocess"), ("launch", "torchrun"), ("slurm", "slurm"), ("netns", "netns")],
)
def test_each_layer_folder_gives_its_tests_the_marker_ci_and_the_docs_select(
    tmp_path: Path, folder: str, marker: str
) -> None:
    layer = layer_of(tmp_path / folder / "test_new.py", tmp_path)
    assert layer is not None and layer.marker == marker
    deeper = layer_of(tmp_path / folder / "more" / "test_new.py", tmp_path)
    assert deeper is not None and deeper.marker == marker


@pytest.mark.parametrize("where", ["test_new.py", "examples/test_new.py", "Unit/test_new.py"])
def test_a_test_file_outside_the_layer_folders_is_refused_naming_the_file_and_every_folder(
    tmp_path: Path, where: str
) -> None:
    with pytest.raises(MisplacedTestFile) as refused:
        layer_of(tmp_path / where, tmp_path)
    message = str(refused.value)
    assert f"{tmp_path.name}/{where} is not in a test layer folder" in message
    assert all(f"{tmp_path.name}/{folder}/  (-m {layer.marker})" in message for folder, layer in LAYERS.items())


def test_files_outside_the_tests_folder_are_not_judged(tmp_path: Path) -> None:
    assert layer_of(tmp_path / "examples" / "test_x.py", tmp_path / "tests") is None


def test_only_another_layers_marker_contradicts_the_folder() -> None:
    unit = LAYERS["unit"]
    assert wrong_layer_markers({"unit", "timeout", "parametrize"}, unit) == []
    assert wrong_layer_markers({"torchrun", "multiprocess", "timeout"}, unit) == ["multiprocess", "torchrun"]


def test_every_layer_marker_is_registered_for_strict_markers(pytestconfig: pytest.Config) -> None:
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert registered >= MARKERS, f"register {sorted(MARKERS - registered)} in pyproject.toml"


def scratch_tree(pytester: pytest.Pytester) -> None:
    """A tests/ folder with this repository's conftest, a unit and a launch test, and the markers."""
    markers = "\n".join(f"    {layer.marker}: {layer.holds}" for layer in LAYERS.values())
    pytester.makeini(f"[pytest]\naddopts = --strict-markers -p no:cacheprovider\nmarkers =\n{markers}\n")
    tests = pytester.mkdir("tests")
    (tests / "conftest.py").write_text(CONFTEST.read_text())
    for folder, name in (("unit", "test_fast"), ("launch", "test_slow")):
        (tests / folder).mkdir()
        (tests / folder / f"{name}.py").write_text(f"def {name}():\n    pass\n")


def test_deselecting_a_layer_by_its_marker_leaves_the_other_folders(pytester: pytest.Pytester) -> None:
    scratch_tree(pytester)
    result = pytester.runpytest_inprocess("--collect-only", "-q", "-m", "not torchrun", "tests")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    collected = [line for line in result.outlines if "::" in line]
    assert collected == ["tests/unit/test_fast.py::test_fast"]
    assert [
        line for line in pytester.runpytest_inprocess("--collect-only", "-q", "-m", "torchrun").outlines if "::" in line
    ] == ["tests/launch/test_slow.py::test_slow"]


def test_a_test_file_directly_in_tests_fails_collection_naming_it(pytester: pytest.Pytester) -> None:
    scratch_tree(pytester)
    (pytester.path / "tests" / "test_stray.py").write_text("def test_stray():\n    pass\n")
    (pytester.path / "tests" / "helper.py").write_text("VALUE = 1\n")  # a helper module is no test file
    result = pytester.runpytest_inprocess("--collect-only", "-q", "-m", "not torchrun", "tests")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    output = result.stdout.str()
    assert "ERROR collecting tests/test_stray.py" in output
    assert "tests/test_stray.py is not in a test layer folder" in output and "tests/unit/  (-m unit)" in output


def test_a_test_marked_for_another_layer_than_its_folders_fails_naming_both(pytester: pytest.Pytester) -> None:
    scratch_tree(pytester)
    (pytester.path / "tests" / "unit" / "test_fast.py").write_text(
        "import pytest\n\n@pytest.mark.torchrun\ndef test_fast():\n    pass\n"
    )
    result = pytester.runpytest_inprocess("-m", "unit", "tests")
    result.assert_outcomes(errors=1)
    assert "is marked torchrun but sits in tests/unit/ (unit)" in result.stdout.str()


def test_test_files_are_handed_out_longest_layers_first_and_the_two_slurm_files_apart() -> None:
    from tests.conftest import TESTS, run_order

    def at(relative: str) -> tuple[int, int]:
        return run_order(TESTS / relative)

    assert at("slurm/test_slurm.py") < at("launch/test_docs_run.py") < at("launch/test_elastic.py")
    assert at("launch/test_elastic.py") < at("netns/test_partitions.py") < at("slurm/test_slurm_quorum.py")
    assert at("slurm/test_slurm_quorum.py") < at("process/test_cli.py") < at("unit/test_layers.py")
