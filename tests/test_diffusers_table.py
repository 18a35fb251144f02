"""README.md's table of the diffusers transformers ``patch_diffusers`` patches, from its checks.

Every transformer class of ``diffusers.models.transformers`` whose module mentions rotary embeddings is
built from its default config (one layer of each kind; :data:`CONFIGS` adds what a few defaults lack) on the
meta device, and ``patch_diffusers``' plan is made for it: the rotation functions found and, for each, the
call forms rope_ext computes, or why the model is refused. Models with a tiny-model check in
``test_diffusers_models.py`` are marked tested. The test asserts README.md holds this table; rewrite it with::

    python tests/test_diffusers_table.py --write README.md
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from rope_ext.compat import TESTED_DIFFUSERS_MODELS  # noqa: E402
from rope_ext.compat.diffusers import patch as dpatch  # noqa: E402
from rope_ext.compat.diffusers.probes import _CheckFailed  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
TABLE_BEGIN = "<!-- diffusers-table:begin -->"
TABLE_END = "<!-- diffusers-table:end -->"

# What a default config leaves out (None) or gets wrong for one layer; nothing here touches RoPE.
CONFIGS = {
    "EasyAnimateTransformer3DModel": dict(in_channels=16, out_channels=16, patch_size=2),
    "HiDreamImageTransformer2DModel": dict(
        patch_size=2, out_channels=16, caption_channels=[64, 64], llama_layers=[0]
    ),
    "HunyuanDiT2DModel": dict(in_channels=4, patch_size=2),
    "LuminaNextDiT2DModel": dict(num_kv_heads=16),
    "OmniGenTransformer2DModel": dict(rope_scaling={"short_factor": [1.0] * 48, "long_factor": [1.0] * 48}),
    "WanVACETransformer3DModel": dict(vace_layers=[0]),
}  # fmt: skip
_MENTIONS_ROPE = re.compile(r"rotary|\brope|_rope|rope_", re.IGNORECASE)
_LAYERS = re.compile(r"(^|_)(layers|blocks|depth)$")


def rope_models() -> list[str]:
    """The transformer classes of diffusers whose module mentions rotary embeddings, by name."""
    from diffusers.models import transformers
    from diffusers.models.modeling_utils import ModelMixin

    found = []
    for name in sorted(dir(transformers)):
        klass = getattr(transformers, name)
        if inspect.isclass(klass) and issubclass(klass, ModelMixin):
            if _MENTIONS_ROPE.search(Path(inspect.getsourcefile(klass)).read_text()):
                found.append(name)
    return found


def build(name: str) -> torch.nn.Module:
    """``name`` from its default config, one layer of each kind, on the meta device."""
    klass = getattr(diffusers, name)
    config = {
        p.name: 1
        for p in inspect.signature(klass.__init__).parameters.values()
        if _LAYERS.search(p.name) and type(p.default) is int and p.default > 1
    }
    config.update(CONFIGS.get(name, {}))
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return klass(**config)


def _short(label: str) -> str:
    return label.removeprefix("diffusers.models.").removeprefix("transformers.")


def row(name: str) -> str:
    """The table's row for model class ``name``."""
    try:
        plan = dpatch._plan(build(name))
    except _CheckFailed as e:
        why = e.short.replace("diffusers.models.transformers.", "").replace("diffusers.models.", "")
        return f"| `{name}` | - | - | refused: {why} |"
    functions, forms = [], []
    for site, specs in plan:
        for (label, _), spec in zip(site.functions, specs, strict=True):
            functions.append(f"`{_short(label)}`")
            forms.append(spec.describe())
    status = "supported, tested" if name in TESTED_DIFFUSERS_MODELS else "supported"
    return f"| `{name}` | {', '.join(functions)} | {'; '.join(dict.fromkeys(forms))} | {status} |"


def render_table(rows: list[str]) -> str:
    """The Markdown between README.md's markers: a line naming the diffusers version, then the table."""
    return "\n".join(
        [
            f"Checked with diffusers {diffusers.__version__} by `tests/test_diffusers_table.py`: each "
            "transformer of `diffusers.models.transformers` that mentions rotary embeddings, built from its "
            "default config on the meta device and checked as `patch_diffusers` would check it (*tested*: a "
            "tiny random model, outputs and gradients against the unpatched model, eager and "
            "`torch.compile(fullgraph=True)`, in `tests/test_diffusers_models.py`); regenerate with "
            "`python tests/test_diffusers_table.py --write README.md`.",
            "",
            "| model | rotation functions | forms rope_ext computes | status |",
            "|---|---|---|---|",
            *rows,
        ]
    )


def replace_table(text: str, table: str) -> str:
    head, sep, rest = text.partition(TABLE_BEGIN)
    _, sep2, tail = rest.partition(TABLE_END)
    if not sep or not sep2:
        raise ValueError(f"README.md needs the markers {TABLE_BEGIN} and {TABLE_END}")
    return f"{head}{TABLE_BEGIN}\n{table}\n{TABLE_END}{tail}"


def table_in(text: str) -> str:
    return text.partition(TABLE_BEGIN)[2].partition(TABLE_END)[0].strip("\n")


_ROWS: dict[str, str] = {}


def rows() -> list[str]:
    if not _ROWS:
        for name in rope_models():
            _ROWS[name] = row(name)
    return list(_ROWS.values())


def test_every_required_model_is_supported_and_tested():
    from test_diffusers_models import CASES

    assert sorted(c.name for c in CASES.values()) == sorted(TESTED_DIFFUSERS_MODELS)
    rows()
    for name in TESTED_DIFFUSERS_MODELS:
        assert _ROWS[name].endswith("| supported, tested |"), _ROWS[name]
    supported = [n for n, r in _ROWS.items() if "| supported" in r]
    assert len(supported) >= 40 and len(_ROWS) >= 55, (len(supported), len(_ROWS))


def test_readme_table_is_current():
    assert table_in(README.read_text()) == render_table(rows()), (
        "README.md's diffusers table is stale: run `python tests/test_diffusers_table.py --write README.md`"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="README", type=Path, help="rewrite this file's table in place")
    args = parser.parse_args(argv)
    table = render_table(rows())
    if args.write is None:
        print(table)
    else:
        args.write.write_text(replace_table(args.write.read_text(), table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
