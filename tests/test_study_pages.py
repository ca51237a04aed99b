"""bench/study_fsdp_reorder.py: regenerating a study page keeps its hand-written reading."""

import importlib.util
from pathlib import Path

STUDY = Path(__file__).resolve().parent.parent / "bench" / "study_fsdp_reorder.py"


def _study():
    spec = importlib.util.spec_from_file_location("flint_bench_study_fsdp_reorder", STUDY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_regenerating_a_page_keeps_its_reading(tmp_path, capsys):
    write = _study()._write_keeping_reading
    page = tmp_path / "study.md"
    write(page, "# Study\n\n| a |\n|---|\n| 1 |\n")  # a new page: the table only
    assert page.read_text() == "# Study\n\n| a |\n|---|\n| 1 |\n"
    page.write_text(page.read_text() + "\n## Reading\n\n- one is the answer.\n")
    write(page, "# Study\n\n| a |\n|---|\n| 2 |\n")
    assert page.read_text() == "# Study\n\n| a |\n|---|\n| 2 |\n\n## Reading\n\n- one is the answer.\n"
    assert "check its figures against the new table" in capsys.readouterr().err
