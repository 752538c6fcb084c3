"""The tiers hold: an unmarked (unit) test that starts a process or takes a repo or server fixture
fails, naming what it did; the marked tiers are `slow`, so the fast lane leaves them out; tests that
share a module-scoped fixture are handed out together, longest first."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiers import work_unit

INI = """
[pytest]
markers =
    integration: x
    e2e: x
    slow: x
"""


def _inner(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    pytester.makeini(INI)
    pytester.makepyfile(test_inner=source)
    with pytest.MonkeyPatch.context() as env:  # the inner session's tests are not the suite's durations
        env.delenv("BATCHLAB_DURATIONS_OUT", raising=False)
        return pytester.runpytest_inprocess("-p", "tests.support.tiers", "-p", "no:cacheprovider", *args)


@pytest.mark.integration  # the inner test starts `true`
def test_an_unmarked_test_that_starts_a_process_fails_naming_it(pytester: pytest.Pytester) -> None:
    source = "import subprocess\n\ndef test_runs_a_command():\n    subprocess.run(['true'], check=True)\n"
    result = _inner(pytester, source)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*tier guard: a unit test started 1 process(es) (true): mark it integration or e2e*"])


@pytest.mark.integration
def test_a_marked_test_may_start_processes(pytester: pytest.Pytester) -> None:
    source = "import subprocess, pytest\n\n@pytest.mark.e2e\ndef test_runs():\n    subprocess.run(['true'])\n"
    _inner(pytester, source).assert_outcomes(passed=1)


def test_an_unmarked_test_taking_a_repo_copy_is_refused_at_collection(pytester: pytest.Pytester) -> None:
    source = "import pytest\n\n@pytest.fixture\ndef repo_copy():\n    return 1\n\ndef test_x(repo_copy):\n    pass\n"
    result = _inner(pytester, source)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_x: a unit test takes repo_copy: mark it integration or e2e*"])


def test_slow_without_a_tier_is_refused_and_the_tiers_are_slow(pytester: pytest.Pytester) -> None:
    result = _inner(pytester, "import pytest\n\n@pytest.mark.slow\ndef test_x():\n    pass\n")
    result.stderr.fnmatch_lines(["*test_x: marked slow without a tier: mark it integration or e2e*"])
    tiers = "import pytest\n\n@pytest.mark.integration\ndef test_i():\n    pass\n\ndef test_unit():\n    pass\n"
    _inner(pytester, tiers, "-m", "not slow").assert_outcomes(passed=1, deselected=1)


def test_tests_taking_a_module_scoped_fixture_are_one_work_unit(tmp_path: Path) -> None:
    (tmp_path / "test_m.py").write_text(
        "import pytest\n\n@pytest.fixture(scope='module')\ndef built():\n    return 1\n\n"
        "def test_a(built):\n    pass\n\ndef test_b(built, tmp_path):\n    pass\n\ndef test_c():\n    pass\n"
    )
    assert work_unit("test_m.py::test_a", tmp_path) == work_unit("test_m.py::test_b[x]", tmp_path) == "test_m.py"
    assert work_unit("test_m.py::test_c", tmp_path) == "test_m.py::test_c"


def test_a_tier_over_its_budget_is_warned_of_beside_its_test_time(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary prints each tier's summed test time beside its budget, and a warning, not a
    failure, when the tier passes it."""
    from tests.support import tiers

    monkeypatch.setitem(tiers.BUDGET_S, "unit", 0.05)
    result = _inner(pytester, "import time\n\ndef test_slow():\n    time.sleep(0.2)\n\ndef test_quick():\n    pass\n")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*unit*2 tests*s of test time (budget 0 s)*",
            "*WARNING: the unit tier took 0 s of test time, over its budget of 0 s*",
        ]
    )
    monkeypatch.setitem(tiers.BUDGET_S, "unit", 100.0)
    result = _inner(pytester, "def test_quick():\n    pass\n")
    assert "WARNING: the unit tier" not in result.stdout.str() and "(budget 100 s)" in result.stdout.str()


def test_each_tier_and_the_heaviest_tests_are_told_in_cpu_seconds(pytester: pytest.Pytester) -> None:
    """A test that computes for ~0.3 s is told at least that, one that sleeps as long near nothing:
    test time stretches with the machine's load, CPU-seconds say where it went."""
    source = (
        "import time\n\ndef test_computes():\n    end = time.process_time() + 0.3\n"
        "    while time.process_time() < end:\n        pass\n\ndef test_sleeps():\n    time.sleep(0.3)\n"
    )
    result = _inner(pytester, source)
    result.assert_outcomes(passed=2)
    lines = result.stdout.str().splitlines()
    told = {line.split()[-1].split("::")[-1]: float(line.split()[0]) for line in lines if "test_inner.py::" in line}
    assert told["test_computes"] >= 0.3 and told["test_sleeps"] < 0.1, lines
    (tier,) = [line for line in lines if " 2 tests " in line]
    assert tier.endswith(" CPU-seconds"), tier


def test_a_parameter_never_recorded_is_handed_out_at_its_siblings_mean() -> None:
    """The chaos test's schedule changes with the commit: a schedule never timed is expected to take
    what the recorded ones took (not 1 s, which would hand a 10-minute test out last)."""
    from tests.support.tiers import UNKNOWN_S, recorded_seconds

    recorded = {"t.py::test_chaos[1]": 100.0, "t.py::test_chaos[2]": 300.0, "t.py::test_other": 5.0}
    assert recorded_seconds("t.py::test_chaos[2]", recorded) == 300.0
    assert recorded_seconds("t.py::test_chaos[13]", recorded) == 200.0
    assert recorded_seconds("t.py::test_new", recorded) == UNKNOWN_S
    assert recorded_seconds("t.py::test_other[x]", {"t.py::test_otherwise[y]": 9.0}) == UNKNOWN_S
