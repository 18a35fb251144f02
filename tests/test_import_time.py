"""What ``import rope_ext`` loads: the ops, not the adapters' or DTensor's dependencies.

transformers (the HF adapters in rope_ext.compat) and torch.distributed.tensor (DTensor, which imports
sympy) are large imports that most processes using the ops never need. rope_ext.compat loads on first
access (``rope_ext.compat``, ``from rope_ext.compat import ...``), transformers only inside the functions
that use it, and the DTensor sharding rules are registered when torch.distributed.tensor is imported
(tests/test_dtensor.py checks a DTensor call in a fresh process, in either import order). Each check runs
in a fresh process: this one has imported everything. How long the import takes is measured, not
asserted here (it depends on the machine).
"""

from __future__ import annotations

import json
import subprocess
import sys

from _helpers import child_env

HEAVY = ("transformers", "torch.distributed.tensor", "rope_ext.compat")


def _new_modules(code: str) -> list[str]:
    """The modules of HEAVY that ``code`` imports in a fresh process that has already imported torch."""
    script = (
        "import json, sys\nimport torch\n"
        f"before = set(sys.modules)\n{code}\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules and m not in before)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=child_env(), timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_rope_ext_imports_neither_transformers_nor_dtensor():
    assert _new_modules("import rope_ext") == []


def test_compat_loads_on_first_access_without_transformers():
    code = (
        "import rope_ext\n"
        "assert 'rope_ext.compat' not in sys.modules\n"
        "assert 'compat' in dir(rope_ext)\n"
        "assert rope_ext.compat.hf.patch_transformers is rope_ext.compat.patch_transformers\n"
        "from rope_ext.compat.hf import HFRotaryAdapter, apply_rotary_pos_emb"
    )
    assert _new_modules(code) == ["rope_ext.compat"]
