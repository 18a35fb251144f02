"""Error classes by design: the C++ checks tag a type or dtype error; the API maps the tag, not the text.

Every ``ROPE_CHECK(TypeError, ...)`` in csrc/ops is triggered below through the public API (TypeError,
untagged message) and through the bare op (ValueError, message starting with the tag); a ValueError
whose message merely contains a type error's words stays a ValueError.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import rope_ext
from rope_ext.cache import cos_sin_rows
from rope_ext.checks import TYPE_ERROR_TAG

ROOT = pathlib.Path(__file__).resolve().parents[1]
CS = rope_ext.RopeCache(16, max_positions=32).cos_sin
T, HQ, HK, D = 3, 4, 2, 16


def _serving(**over):
    a = dict(
        q=torch.randn(T, HQ, D),
        k=torch.randn(T, HK, D),
        v=torch.randn(T, HK, D),
        positions=torch.arange(T),
        cos_sin=CS,
        key_cache=torch.zeros(2, 4, HK, D),
        value_cache=torch.zeros(2, 4, HK, D),
        slot_mapping=torch.arange(T),
    )
    kw = {n: over.pop(n) for n in list(over) if n not in a}
    a.update(over)
    return lambda: rope_ext.apply_rotary_qk_and_cache_(*a.values(), **kw)


def _bare_serving(**over):
    a = dict(
        q=torch.randn(T, HQ, D),
        k=torch.randn(T, HK, D),
        v=torch.randn(T, HK, D),
        positions=torch.arange(T),
        cos_sin=CS,
        key_cache=torch.zeros(2, 4, HK, D),
        value_cache=torch.zeros(2, 4, HK, D),
        slot_mapping=torch.arange(T),
        k_scale=None,
        v_scale=None,
        q_out=None,
        q_scale=None,
    )
    kw = {n: over.pop(n) for n in list(over) if n not in a}
    a.update(over)
    return lambda: torch.ops.rope_ext.rotary_qk_cache_(*a.values(), **kw)


def _rerotate(**over):
    """(public call, bare op call) of rerotate_kv_cache_ with the arguments ``over`` replaces."""
    a = dict(key_cache=torch.zeros(2, 4, HK, D), slot_mapping=torch.arange(T))
    a |= dict(delta=torch.ones(T, dtype=torch.int64), cos_sin=CS)
    a.update(over)
    return (
        lambda: rope_ext.rerotate_kv_cache_(*a.values()),
        lambda: torch.ops.rope_ext.rerotate_kv_cache_(*a.values()),
    )


def _norm(q_weight, bare=False):
    q, k = torch.randn(T, HQ, D), torch.randn(T, HK, D)
    if bare:
        return lambda: torch.ops.rope_ext.qk_norm_rotary(q, k, q_weight, torch.ones(D), torch.arange(T), CS)
    return lambda: rope_ext.apply_qk_norm_rotary(q, k, q_weight, torch.ones(D), torch.arange(T), CS)


X = torch.randn(T, HQ, D)
POS = torch.arange(T)[:, None]
E4M3 = torch.float8_e4m3fn
QKV_INT = torch.zeros(T, 4 * D, dtype=torch.int32)
# A page table (batch_indices, positions, kv_indices, kv_indptr) whose batch_indices are float.
PAGE_TABLE_F32 = [torch.zeros(T), torch.arange(T), torch.tensor([0]), torch.tensor([0, 1])]
# message fragment: (public call, bare op call)
CASES = {
    "x must be a floating tensor": (
        lambda: rope_ext.apply_rotary(X.int(), POS, CS),
        lambda: torch.ops.rope_ext.rotary(X.int(), POS, CS),
    ),
    "k must have the dtype of q": (
        lambda: rope_ext.apply_rotary_qk(X, X.double(), POS, CS),
        lambda: torch.ops.rope_ext.rotary_qk(X, X.double(), POS, CS),
    ),
    "cos_sin must be float32 or the dtype of": (
        lambda: rope_ext.apply_rotary(X.half(), POS, CS.double()),
        lambda: torch.ops.rope_ext.rotary(X.half(), POS, CS.double()),
    ),
    "cos_sin of shape [rotary_dim] (frequencies, then factors) must be float64": (
        lambda: rope_ext.apply_rotary(X, POS, CS[0]),
        lambda: torch.ops.rope_ext.rotary(X, POS, CS[0]),
    ),
    "positions must be int32, int64, float32 or float64": (
        lambda: cos_sin_rows(torch.arange(T).half(), torch.ones(4, dtype=torch.float64)),
        lambda: torch.ops.rope_ext._angle_rows(torch.arange(T).half(), torch.ones(8, dtype=torch.float64)),
    ),
    "positions must be an int32 or int64 tensor": (
        lambda: rope_ext.apply_rotary(X, POS.float(), CS),
        lambda: torch.ops.rope_ext.rotary(X, POS.float(), CS),
    ),
    "v must have the dtype of q": (
        _serving(v=torch.randn(T, HK, D).double()),
        _bare_serving(v=torch.randn(T, HK, D).double()),
    ),
    "q_out must have the dtype of q": (
        _serving(q_out=torch.empty(T, HQ, D, dtype=torch.float64)),
        _bare_serving(q_out=torch.empty(T, HQ, D, dtype=torch.float64)),
    ),
    "key_cache must have the dtype of q": (
        _serving(key_cache=torch.zeros(2, 4, HK, D).double(), value_cache=torch.zeros(2, 4, HK, D).double()),
        _bare_serving(
            key_cache=torch.zeros(2, 4, HK, D).double(), value_cache=torch.zeros(2, 4, HK, D).double()
        ),
    ),
    "value_cache must have the dtype of key_cache": (
        _serving(value_cache=torch.zeros(2, 4, HK, D).half()),
        _bare_serving(value_cache=torch.zeros(2, 4, HK, D).half()),
    ),
    "slot_mapping must be an int64 tensor": (
        _serving(slot_mapping=torch.arange(T, dtype=torch.int32)),
        _bare_serving(slot_mapping=torch.arange(T, dtype=torch.int32)),
    ),
    "slot_mapping must be a tensor, got None (or pass page_table)": (
        _serving(slot_mapping=None),
        _bare_serving(slot_mapping=None),
    ),
    "page_table's batch_indices must be an int32 or int64 tensor": (
        _serving(slot_mapping=None, page_table=PAGE_TABLE_F32),
        _bare_serving(slot_mapping=None, page_table=PAGE_TABLE_F32),
    ),
    "k_scale must be a float32 tensor of one element": (
        _serving(
            key_cache=torch.zeros(2, 4, HK, D, dtype=E4M3),
            value_cache=torch.zeros(2, 4, HK, D, dtype=E4M3),
            k_scale=torch.ones(1, dtype=torch.float64),
        ),
        _bare_serving(
            key_cache=torch.zeros(2, 4, HK, D, dtype=E4M3),
            value_cache=torch.zeros(2, 4, HK, D, dtype=E4M3),
            k_scale=torch.ones(1, dtype=torch.float64),
        ),
    ),
    "q_weight must be a floating tensor": (
        _norm(torch.ones(D, dtype=torch.int32)),
        _norm(torch.ones(D, dtype=torch.int32), bare=True),
    ),
    "qkv must be a floating tensor": (
        lambda: rope_ext.apply_qk_norm_rotary_(QKV_INT, 2, 1, 1, torch.ones(D), torch.ones(D), POS[:, 0], CS),
        lambda: torch.ops.rope_ext.qk_norm_rotary_packed_(
            QKV_INT, 2, 1, 1, torch.ones(D), torch.ones(D), POS[:, 0], CS
        ),
    ),
    "key_cache must be a float or fp8 tensor": _rerotate(key_cache=torch.zeros(2, 4, HK, D).to(torch.int8)),
    "delta must be an int32 or int64 tensor": _rerotate(delta=torch.ones(T)),
    "cos_sin must be float32 or the dtype of key_cache": _rerotate(cos_sin=CS.double()),
    "cos_sin must be float32 for an fp8 key_cache": _rerotate(
        key_cache=torch.zeros(2, 4, HK, D, dtype=E4M3), cos_sin=CS.to(E4M3)
    ),
}
# Checks no Python call reaches: a non-optional Tensor argument of a schema cannot be None.
# The private _angle_rows' freqs: its one caller (cos_sin_rows) makes them float64.
UNREACHABLE = (
    " must be a tensor, got None",
    "qkv must be a tensor",
    "cos_sin must be a tensor",
    "freqs must be float64",
)


@pytest.mark.parametrize("fragment", list(CASES))
def test_type_errors_are_tagged_and_mapped(fragment):
    public, bare = CASES[fragment]
    with pytest.raises(TypeError) as e:
        public()
    assert fragment in str(e.value) and not str(e.value).startswith(TYPE_ERROR_TAG)
    with pytest.raises(ValueError) as e:
        bare()
    assert str(e.value).startswith(TYPE_ERROR_TAG + fragment.split(" ")[0]), str(e.value)
    assert type(e.value) is ValueError


def test_every_cpp_type_check_is_covered():
    """Each TypeError check in csrc/ops is in CASES (or provably unreachable from Python)."""
    found = set()
    for path in (ROOT / "csrc" / "ops").rglob("*.cpp"):
        for call in re.findall(r"ROPE_CHECK\(TypeError,(.*?)\);", path.read_text(), flags=re.S):
            literal = next(m for m in re.findall(r'"((?:[^"\\]|\\.)*)"', call) if "must" in m)
            found.add(literal.strip())
    assert found, "no TypeError check found: the scan is broken"
    messages = " | ".join(CASES)
    for literal in found:
        head = literal.split(" (")[0].split(", got")[0]
        covered = head in messages or any(head in u or u in literal for u in UNREACHABLE)
        assert covered, f"ROPE_CHECK(TypeError, ...) {literal!r} has no case in CASES"


def test_value_error_with_type_words_stays_value_error():
    """A message that contains a type error's words (the text of an argument) is not retyped."""
    with pytest.raises(ValueError, match="layout must be"):
        _serving(layout=" must be a floating tensor")()
    with pytest.raises(ValueError, match="layout must be"):
        _serving(layout="[type] x")()
