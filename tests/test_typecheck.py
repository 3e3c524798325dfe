"""The type check: mypy over the package as Python imports it (scripts/typecheck.py builds the
kvfuzz.* link tree across pyproject's package-dir map). Any error fails; modules with known
errors are listed in pyproject's [tool.mypy] overrides, and only there."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import typecheck  # noqa: E402

# A wrong type handed from one room to another (kvfuzz.traces into kvfuzz.oracle): the check
# must see it, i.e. resolve the package-dir map instead of treating the imports as Any.
BAD_SEAM = ("from kvfuzz.oracle.noise import finding_bounds\nfrom kvfuzz.traces import Trace\n\n\n"
            "def f(t: Trace) -> None:\n    finding_bounds(t)\n")


def test_the_link_tree_is_the_package_as_imported(tmp_path):
    paths = typecheck.link_tree(tmp_path)
    assert (tmp_path / "kvfuzz" / "traces" / "finding.py").resolve() == ROOT / "traces" / "finding.py"
    assert (tmp_path / "kvfuzz" / "driver" / "session.py").resolve() == ROOT / "kvfuzz" / "driver" / "session.py"
    assert paths["kvfuzz/oracle/"] == "oracle/"


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install -e '.[test]' brings it)")
def test_the_package_type_checks_and_a_bad_seam_does_not():
    # One mypy run (about 7 s of CPU): the package plus one deliberately wrong module.
    code, lines = typecheck.check({"kvfuzz/bad_seam.py": BAD_SEAM})
    errors = [ln for ln in lines if ": error:" in ln]
    assert code == 1 and len(errors) == 1, "\n".join(lines)
    assert errors[0].startswith("kvfuzz/bad_seam.py:6:") and 'type "Trace"; expected "Finding"' in errors[0]
