"""The quantized formats come from one table (``rust/kernels/quant/formats.rs``) and every
other place reads it: Python's names, block layouts and GGUF map equal Rust's rows in
the order of their codes (``QuantType::ALL``), the GGUF formats' layouts equal the
``gguf`` package's, every format has its FFI targets, and ``kvpage.quant``'s modules
import one another without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import gguf
import numpy as np
import pytest
from kvpage import _core
from kvpage.kernels.host import cpu_qmatmul
from kvpage.quant import QuantizedWeight, formats, gguf_blocks, modes, weights

QUANT_DIR = Path(formats.__file__).parent


def test_python_tables_are_rusts_rows_in_code_order() -> None:
    rows = _core.quant_formats()
    assert [code for code, *_ in rows] == list(range(len(rows)))
    assert formats.KINDS == tuple(name for _, name, *_ in rows)
    assert formats.BLOCK_LAYOUTS == {name: (elems, size) for _, name, elems, size, _, _ in rows}
    assert list(formats.BLOCK_LAYOUTS) == list(formats.KINDS)
    # Every user reads the same objects, none a copy of its own.
    assert cpu_qmatmul.KINDS is formats.KINDS
    assert weights.BLOCK_LAYOUTS is formats.BLOCK_LAYOUTS is gguf_blocks.BLOCK_LAYOUTS
    assert modes.GGUF_KEPT is formats.GGUF_KEPT


def test_int8_is_recorded_as_the_kernels_read_it() -> None:
    """A block of 32 int8 weights in 32 bytes, with a float scale per row (once a block
    of one weight in Python, 32 in Rust)."""
    assert formats.BLOCK_LAYOUTS["int8"] == (32, 32)
    assert formats.ROW_SCALED == {"int8"}
    assert "int8" not in formats.GGUF_KEPT.values()
    assert formats.row_bytes("int8", 96) == 96
    with pytest.raises(ValueError, match="multiple of 32"):
        formats.row_bytes("int8", 48)


@pytest.mark.parametrize("gguf_name", sorted(formats.GGUF_KEPT))
def test_gguf_formats_match_the_gguf_package(gguf_name: str) -> None:
    kind = formats.GGUF_KEPT[gguf_name]
    assert formats.BLOCK_LAYOUTS[kind] == gguf.GGML_QUANT_SIZES[
        gguf.GGMLQuantizationType[gguf_name]
    ]
    assert kind not in formats.ROW_SCALED


def test_every_format_has_its_ffi_targets_and_weights() -> None:
    for kind in formats.KINDS:
        assert cpu_qmatmul.available(kind), kind
        elems, size = formats.BLOCK_LAYOUTS[kind]
        scales = np.ones(3, np.float32) if kind in formats.ROW_SCALED else None
        QuantizedWeight(np.zeros((3, 2 * size), np.uint8), kind, (3, 2 * elems), row_scales=scales)


def _quant_imports(path: Path) -> set[str]:
    """The ``kvpage.quant`` modules ``path`` imports, anywhere in it (function bodies too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "kvpage.quant":
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("kvpage.quant."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvpage.quant."):
                    found.add(alias.name.split(".")[2])
    return found


def test_quant_modules_import_one_another_without_a_cycle() -> None:
    modules = {p.stem: p for p in QUANT_DIR.glob("*.py") if p.stem != "__init__"}
    graph = {name: _quant_imports(path) & set(modules) for name, path in modules.items()}
    assert graph["formats"] == set(), "formats.py is the leaf"
    done: set[str] = set()

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, f"import cycle: {' -> '.join((*stack, name))}"
        if name in done:
            return
        for dep in graph[name]:
            visit(dep, (*stack, name))
        done.add(name)

    for name in graph:
        visit(name, ())
