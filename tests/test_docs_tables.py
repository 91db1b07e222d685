"""Every benchmark table and measured figure in the README and the docs is the one its CSV gives
(benchmarks/tables.py)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from tests.helpers import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"


@pytest.fixture(scope="module")
def tables():
    sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import the shared tools and the wings from here
    try:
        spec = importlib.util.spec_from_file_location("benchmark_tables", BENCHMARKS / "tables.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up there
        spec.loader.exec_module(module)
        yield module
    finally:  # the benchmark modules it imported (``bench``, ``claims.precision``, …) go too
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", "") or "").startswith(str(BENCHMARKS)):
                del sys.modules[name]
        sys.path.remove(str(BENCHMARKS))


def test_every_marked_table_matches_its_csv(tables):
    differing = tables.stale()
    assert not differing, "tables that differ from their CSV (run `python benchmarks/tables.py`):\n" + "\n".join(
        differing
    )


def test_the_readme_and_the_benchmarks_page_have_generated_tables_and_figures(tables):
    keys = {table.key for table in tables.marked_tables(tables.documents())}
    assert {"memory_profile.csv highlights", "activation_checkpointing.csv highlights"} <= keys
    assert {"memory_profile.csv", "precision.csv", "plan_vs_sweep.csv"} <= keys
    assert {"gpu_truth_h200.csv readme", "memory_h200.csv readme", "gpu_truth_h100.csv readme"} <= keys
    assert {"activation_checkpointing.csv targets", "compile_budget.csv targets", "gpu_truth_h100.csv summary"} <= keys


def test_no_figure_is_typed_outside_a_generated_block(tables):
    typed = tables.typed_figures()
    assert not typed, "figures typed outside a generated block (generate them, or remove them):\n" + "\n".join(typed)


def test_a_typed_figure_is_found_but_not_a_target_code_or_a_generated_one(tables, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Full checkpointing measured 1.54× on the H200.\n"
        "Target: ≤ 1.45× step time, `budget=0.5 s`.\n\n"
        "<!-- figures: fake_vs_real.csv summary -->\n\n3.50× less\n\n<!-- /figures -->\n\n"
        "```bash\nrun  # 2.5 min\n```\n"
    )
    assert tables.typed_figures([page]) == [f"{page}:1 1.54×"]


def test_a_figure_in_prose_goes_stale_with_its_csv_and_is_rewritten(tables, tmp_path):
    page, csv = tmp_path / "page.md", tmp_path / "fake_vs_real.csv"
    page.write_text("Before.\n\n<!-- figures: fake_vs_real.csv summary -->\n\nstale\n\n<!-- /figures -->\n")
    csv.write_text("case,precision,fake_over_real\ntiny b2,32-true,1.0\ntiny b2,bf16-mixed,0.99\n")
    assert tables.rewrite([page], benchmarks=tmp_path) == ([f"{page}:3 fake_vs_real.csv summary"], [])
    assert "**1.00%** (target 3%), in bf16-mixed on `tiny b2`" in page.read_text()
    csv.write_text(csv.read_text().replace(",0.99", ",0.98"))
    assert tables.stale([page], benchmarks=tmp_path) == [f"{page}:3 fake_vs_real.csv summary"]
    tables.rewrite([page], benchmarks=tmp_path)
    text = page.read_text()
    assert "**2.00%**" in text and text.startswith("Before.\n\n<!-- figures: fake_vs_real.csv summary -->\n\n")
    assert text.endswith("\n\n<!-- /figures -->\n")


def test_a_model_timed_at_a_smaller_input_says_so_in_its_label(tables, tmp_path):
    """The README's checkpointing table: a model whose times were taken at a smaller input than its bytes were
    counted at carries both sizes in its label (the CSV's note says which)."""
    rows = ["model,policy,activation_peak_mib,reduction,step_time_ratio,note"]
    for policy in ("none", "full", "selective", "budget=0.5"):
        rows.append(f'"tracker (768 tracks)",{policy},1024,2.0,1.1,"timed at 384 tracks: too big for this machine"')
        rows.append(f'"resnet (batch 8)",{policy},2048,2.0,1.1,')
    (tmp_path / "activation_checkpointing.csv").write_text("\n".join(rows) + "\n")
    table = tables.render("activation_checkpointing.csv highlights", tmp_path)
    labels = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    assert labels == ["tracker (768 tracks; timed at 384 tracks)", "resnet (batch 8)"]


def test_every_registry_entry_resolves_to_a_function(tables):
    for key in tables.REGISTRY:
        assert callable(tables.renderer(key)), key


def test_the_precision_and_memory_profile_tables_show_the_same_activations(tables):
    """Both come from memory_profile.profile_preset; the precision table reads memory_profile.csv's rows."""
    profiles = {
        (row["preset"], row["precision"]): row for row in tables.read_rows(BENCHMARKS / "claims" / "memory_profile.csv")
    }
    precision_rows = tables.render("precision.csv").splitlines()[2:]
    for line in precision_rows:
        preset, _, fp32, bf16 = (cell.strip() for cell in line.strip("|").split("|")[:4])
        assert fp32 == f"{float(profiles[(preset, 'fp32')]['activations_gib']):.2f}"
        assert bf16 == f"{float(profiles[(preset, 'bf16-mixed')]['activations_gib']):.2f}"


def test_rewrite_restores_a_changed_table_and_check_finds_it(tables, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Intro.\n\n<!-- table: concurrent_rows.csv -->\n\n| stale |\n\n<!-- /table -->\n\nAfter.\n")
    assert [line.split()[-1] for line in tables.stale([page])] == ["concurrent_rows.csv"]
    changed, failed = tables.rewrite([page])
    assert len(changed) == 1 and not failed
    assert tables.stale([page]) == []
    text = page.read_text()
    assert text.startswith("Intro.\n\n<!-- table: concurrent_rows.csv -->\n\n| results_csv append |")
    assert text.endswith("\n\n<!-- /table -->\n\nAfter.\n")
    assert tables.rewrite([page]) == ([], [])  # a second run changes nothing


def test_an_unknown_key_or_a_missing_csv_is_reported_not_skipped(tables, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- table: nothing_like_it.csv -->\n\n| x |\n\n<!-- /table -->\n")
    (reported,) = tables.stale([page])
    assert "nothing_like_it.csv" in reported and "no table is registered" in reported
    changed, failed = tables.rewrite([page])
    assert not changed and len(failed) == 1
    assert "| x |" in page.read_text()  # left as it was


def test_check_exits_zero_when_every_table_matches(tables, capsys):
    assert tables.main(["--check"]) == 0
    assert "match their CSVs" in capsys.readouterr().out


def test_a_module_of_a_scripts_name_elsewhere_is_not_taken_for_the_script(tables, monkeypatch):
    monkeypatch.setitem(sys.modules, "foreign_models", types.ModuleType("foreign_models"))  # tests/foreign_models.py
    monkeypatch.delitem(sys.modules, "claims.foreign_models", raising=False)
    render = tables.renderer("foreign_models.csv")
    assert render.__module__ == "claims.foreign_models"
