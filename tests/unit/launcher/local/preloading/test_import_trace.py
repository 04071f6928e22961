"""Which modules of an unsafe import the helper refuses (``import_trace.ImportTrace``)."""

from __future__ import annotations

import builtins
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbaccel.launcher.local.preloading.import_trace import ImportTrace

# A made-up dependency tree; ``tr_cul.core`` is the module whose import "starts a thread"
# (it marks tr_flag, which the probe reads). tr_top imports tr_mid, which imports tr_cul;
# then tr_other, which imports tr_cul.core again (loaded by then); tr_safe leads nowhere.
MODULES = {
    "tr_flag.py": "FIRED = []\n",
    "tr_top.py": "import tr_safe\nimport tr_mid\nimport tr_other\n",
    "tr_mid.py": "from tr_cul import core\n",
    "tr_cul/__init__.py": "from . import core\n",
    "tr_cul/core.py": "import tr_flag\ntr_flag.FIRED.append(1)\n",
    "tr_other.py": "import tr_cul.core\n",
    "tr_safe.py": "import json\n",
}


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name, code in MODULES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [m for m in sys.modules if m.startswith("tr_")]:
        del sys.modules[name]


THREAD = "it started a thread at import"


def fired() -> str | None:
    flag = sys.modules.get("tr_flag")
    return THREAD if flag is not None and flag.FIRED else None


def test_the_chain_and_what_imports_it_are_refused_not_what_leads_elsewhere(tree: None) -> None:
    with ImportTrace(fired) as trace:
        import tr_top  # noqa: F401
    assert trace.chain(THREAD) == ("tr_top", "tr_mid", "tr_cul", "tr_cul.core")
    assert trace.culprit("tr_top", THREAD) == "tr_cul.core"
    # tr_other imported tr_cul.core after tr_mid had loaded it: it leads there too. A
    # package stands for its submodules (tr_cul.core goes with tr_cul).
    assert trace.refused("tr_top", THREAD) == ["tr_cul", "tr_mid", "tr_other", "tr_top"]


def test_an_import_that_leads_to_no_hazard_has_no_chain(tree: None) -> None:
    with ImportTrace(fired) as trace:
        import tr_safe  # noqa: F401
    assert trace.chain(THREAD) is None
    assert trace.refused("tr_safe", THREAD) == ["tr_safe"]  # all there is to say of it


def test_a_hazard_that_went_away_again_is_not_the_one_blamed(tree: None, tmp_path: Path) -> None:
    # tr_passing starts a thread and joins it; tr_late (loaded after) starts one for good.
    (tmp_path / "tr_passing.py").write_text("import tr_flag\ntr_flag.FIRED.append(1)\n")
    (tmp_path / "tr_calm.py").write_text("import tr_flag\ntr_flag.FIRED.clear()\n")
    (tmp_path / "tr_late.py").write_text("import tr_flag\ntr_flag.FIRED.append(1)\n")
    (tmp_path / "tr_both.py").write_text("import tr_passing, tr_calm, tr_safe, tr_late\n")
    with ImportTrace(fired) as trace:
        import tr_both  # noqa: F401
    assert trace.chain(THREAD) == ("tr_both", "tr_late")
    assert trace.refused("tr_both", THREAD) == ["tr_both", "tr_late"]


def test_the_import_machinery_is_put_back(tree: None) -> None:
    real, finders = builtins.__import__, list(sys.meta_path)
    with ImportTrace(fired):
        assert builtins.__import__ is not real and len(sys.meta_path) == len(finders) + 1
        import tr_top  # noqa: F401
    assert builtins.__import__ is real and sys.meta_path == finders
