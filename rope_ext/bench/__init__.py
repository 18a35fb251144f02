"""rope-bench: benchmark harness for rotary-embedding kernels (``python -m rope_ext.bench``).

For every workload (model preset or custom shape, token count, dtype, pairing) the harness:

1. builds ``q [T, Hq, D]``, ``k [T, Hkv, D]`` (token-major, contiguous), ``positions`` (``0..T-1`` for a
   prefill, each sequence's own for a packed prefill (``--seqs``), random positions of a batch of
   sequences for a decode step; ``[3, T]`` for MRoPE presets, ``[n_axes, T]`` for the vision and diffusion
   presets, whose table restarts its frequencies per axis) and a float32 cos/sin cache;
2. validates every provider against the float64 reference (:func:`rope_ext.reference.rotary_hadamard`)
   on the same inputs; a provider that disagrees is reported as ``wrong`` and is not timed;
3. times the providers and the bandwidth ceilings of this machine side by side: several rounds, each
   running every provider and every ceiling once in turn, so that noise from other processes hits them
   alike; the median over all rounds is reported with its spread (25th-75th percentiles).

The default modes time the rotation (``inplace``, ``out``, ``backward``). The serving modes run only when
``--mode`` names them, on the same workloads: ``cache`` / ``cache-fp8`` (RoPE + paged KV-cache write from
views of a packed qkv, caches of q's dtype / float8_e4m3fn; fused ``rope_ext.apply_rotary_qk_and_cache_``
against the two-op eager path, validated on q, k and both caches, ``% ceil`` against ``stream cache``)
``qknorm`` (fused QK-RMSNorm + RoPE on the packed qkv against eager and ``torch.compile`` unfused
references, validated against :func:`rope_ext.reference.qk_norm_rotary`) and, on presets with an MLA shape
(``deepseek-v3``), ``mla`` / ``mla-fp8`` (RoPE + MLA latent-cache write: fused
``rope_ext.apply_mla_rotary_and_cache_`` against the eager and ``torch.compile`` unfused path a server
writes by hand, validated on q, k_pe and the cache, ``% ceil`` against ``stream mla``) and, on every preset,
``rerotate`` / ``rerotate-fp8`` (the keys of T tokens in a paged KV cache of q's dtype / float8_e4m3fn
rotated in place by per-token shifts: ``rope_ext.rerotate_kv_cache_`` against the eager and ``torch.compile``
gather-rotate-scatter a server writes by hand, validated on the whole cache, ``% ceil`` against ``stream
rerotate``).

The parts:

* :mod:`.baselines` - the HF-style eager formula (the baseline, in the input dtype);
* :mod:`.presets` - model presets (attention shapes; :class:`Axes` for FLUX, Wan, Qwen2-VL's vision
  tower), default token counts, dtypes, modes (the serving modes, the KV-cache block size);
* :mod:`.workloads` - :class:`Config`, one workload's inputs (:class:`Case`, :func:`make_case`; the
  serving modes' :class:`ServingInputs`), input sets;
* :mod:`.mla` - the MLA modes' inputs (:class:`MlaInputs`), bytes and unfused reference;
* :mod:`.rerotate` - the rerotate modes' inputs (:class:`RerotateInputs`), bytes, unfused reference and
  float64 expected cache;
* :mod:`.providers` - the registry (:func:`provider`, :class:`Provider`, :class:`Skip`) and one module per
  provider family (rope_ext, the HF references, the vision / diffusion models' own RoPE code, vLLM,
  FlashInfer, flash-attn, Liger);
* :mod:`.ceilings` - what the machine does with the same bytes (in-place stream, clone, copy, no-op op,
  tiny kernel; the serving modes' ``stream cache``, ``stream mla``, ``stream rerotate``);
* :mod:`.parts` - pieces of a provider's work timed on their own (``varlen_positions``);
* :mod:`.timing` - blocked CPU timing, CUDA events with the L2 flushed, statistics, allocator modes;
* :mod:`.validation` - the check against the float64 reference (the serving modes': their references and
  tolerances);
* :mod:`.runner` - :func:`run_benchmark` and the derived columns;
* :mod:`.report` - table, summary lines, JSON, CSV, plot;
* :mod:`.cli` - the command line (:func:`main`).

Adding a provider is one small function decorated with :func:`provider`; see the existing ones.
"""

from __future__ import annotations

from .baselines import hf_apply_rotary_pos_emb, hf_rotate_every_two, hf_rotate_half
from .ceilings import CEILING_FOR_MODE, ceiling_bytes, noop_op
from .cli import config_from_args, main, parse_args
from .mla import MlaInputs, mla_rotary_cache_unfused_
from .parts import PART_OF, parts
from .presets import (
    ALL_MODES,
    DECODE_CONTEXT,
    DECODE_TOKENS,
    DTYPES,
    KV_BLOCK_SIZE,
    MLA_BLOCK_SIZE,
    MLA_MODES,
    MODES,
    PREFILL_TOKENS,
    PRESETS,
    REROTATE_MODES,
    SERVING_MODES,
    VISION_TARGETS,
    Axes,
    Mla,
    Preset,
)
from .providers import PROVIDERS, Builder, Provider, Runner, Skip, provider
from .report import (
    CEILING_STYLE,
    CSV_FIELDS,
    SERVING_FLOORS,
    TABLE_COLUMNS,
    plot,
    print_table,
    summary,
    table_rows,
    write_csv,
    write_json,
)
from .rerotate import RerotateInputs, rerotate_unfused_
from .runner import machine_info, run_benchmark
from .timing import Timer, set_cpu_allocator
from .validation import check, validate
from .workloads import (
    Case,
    Config,
    ServingInputs,
    axes_prefill_positions,
    input_sets,
    last_level_cache_bytes,
    make_case,
    mrope_prefill_positions,
    packed_cu_seqlens,
    split_qkv,
)

__all__ = [
    "ALL_MODES",
    "CEILING_FOR_MODE",
    "CEILING_STYLE",
    "CSV_FIELDS",
    "DECODE_CONTEXT",
    "DECODE_TOKENS",
    "DTYPES",
    "KV_BLOCK_SIZE",
    "MLA_BLOCK_SIZE",
    "MLA_MODES",
    "MODES",
    "PART_OF",
    "PREFILL_TOKENS",
    "PRESETS",
    "PROVIDERS",
    "REROTATE_MODES",
    "SERVING_FLOORS",
    "SERVING_MODES",
    "TABLE_COLUMNS",
    "VISION_TARGETS",
    "Axes",
    "Builder",
    "Case",
    "Config",
    "Mla",
    "MlaInputs",
    "Preset",
    "Provider",
    "RerotateInputs",
    "Runner",
    "ServingInputs",
    "Skip",
    "Timer",
    "axes_prefill_positions",
    "ceiling_bytes",
    "check",
    "config_from_args",
    "hf_apply_rotary_pos_emb",
    "hf_rotate_every_two",
    "hf_rotate_half",
    "input_sets",
    "last_level_cache_bytes",
    "machine_info",
    "main",
    "make_case",
    "mla_rotary_cache_unfused_",
    "mrope_prefill_positions",
    "noop_op",
    "packed_cu_seqlens",
    "parse_args",
    "parts",
    "plot",
    "print_table",
    "provider",
    "rerotate_unfused_",
    "run_benchmark",
    "set_cpu_allocator",
    "split_qkv",
    "summary",
    "table_rows",
    "validate",
    "write_csv",
    "write_json",
]
