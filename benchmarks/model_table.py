"""README.md's table of the transformers families ``patch_transformers`` supports, from the per-family check.

Runs ``tests/hf_check.py``'s :func:`check` on every family (tiny random models: logits and gradients of
the patched model against the unpatched one, eager and ``torch.compile(fullgraph=True)``, rope_ext op
calls, sensitivity to a wrong rotation) and prints the table, or rewrites the part of a README between
``<!-- model-table:begin -->`` and ``<!-- model-table:end -->`` with it::

    python benchmarks/model_table.py                    # print the table
    python benchmarks/model_table.py --write README.md  # rewrite README.md's table
    python benchmarks/model_table.py --verbose          # also each family's errors and time (stderr)

``tests/test_hf_families.py`` checks that README.md holds this script's output for the current results.
Exits 1 when a family fails its check (the table is written all the same: its status column says why).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import hf_check  # noqa: E402
import hf_families  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="README", type=Path, help="rewrite this file's table in place")
    parser.add_argument("--verbose", action="store_true", help="print each family's numbers to stderr")
    args = parser.parse_args(argv)

    results = []
    for family in hf_families.FAMILIES.values():
        r = hf_check.check(family)
        results.append(r)
        if args.verbose:
            print(
                f"{r.model_type:16s} {r.status[:60]:60s} logits {r.logit_err:.2e} grads {r.grad_err:.2e} "
                f"compiled {r.compiled_logit_err:.2e} / {r.compiled_grad_err:.2e} "
                f"wrong rotation {r.wrong_rotation_change:.3g} {r.seconds:.1f}s",
                file=sys.stderr,
            )
    table = hf_check.render_table(results)
    if args.write is None:
        print(table)
    else:
        text = args.write.read_text()
        args.write.write_text(hf_check.replace_table(text, table))
    return 1 if any(r.status.startswith("fails") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
