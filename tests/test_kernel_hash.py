"""The kernel hash that tuning records carry: code edits change it, comment, docstring and layout
edits do not, and it covers only the modules the tile programs use (no host-side code)."""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import tokenize

import pytest

from tileops import spec as spec_module
from tileops.ops import SPECS
from tileops.spec import _tileops_imports, code_tokens

KERNEL_MODULES = sorted({spec.kernel_module for spec in SPECS.values()})
# Every module some kernel hash covers: the kernel modules and the helpers they import.
HASHED = sorted({m for k in KERNEL_MODULES for m in (k, *_tileops_imports(k))})
# Host-side code: how kernels are called and configured, and the MXFP4 codec.
HOST_ONLY = {"tileops.ops.host", "tileops.ops.mxfp4.format", "tileops.spec", "tileops.dispatch"}


def source(module: str) -> str:
    return inspect.getsource(importlib.import_module(module))


def _tokens(src: str) -> list[tokenize.TokenInfo]:
    """The tokens of a source outside its docstrings (which are STRING tokens too)."""
    docstrings = {n.body[0].lineno for n in ast.walk(ast.parse(src))
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and ast.get_docstring(n, clean=False) is not None}
    return [t for t in tokenize.generate_tokens(io.StringIO(src).readline)
            if t.start[0] not in docstrings]


def _replace(src: str, tok: tokenize.TokenInfo, new: str) -> str:
    lines = src.splitlines(keepends=True)
    (row, c0), (_, c1) = tok.start, tok.end
    lines[row - 1] = lines[row - 1][:c0] + new + lines[row - 1][c1:]
    return "".join(lines)


def with_comments(src: str) -> str:
    """A comment after the first line of code, and a comment line below it, indented deeper."""
    newline = next(t for t in _tokens(src) if t.type == tokenize.NEWLINE)
    return _replace(src, newline, "  # a new note\n        # a new comment line\n")


def with_docstrings_rewritten(src: str) -> str:
    """The module docstring rewritten over more lines, and the first function's replaced."""
    tree = ast.parse(src)
    functions = [n for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef) and ast.get_docstring(n) is not None]
    edits = [(tree, '"""A new module docstring.\n\nTwo paragraphs.\n"""')]
    edits += [(f, "'''Another explanation, with a non-ASCII dash \u2014 here.'''")
              for f in functions[:1]]
    out = src
    for node, new in edits:
        out = out.replace(ast.get_source_segment(src, node.body[0]), new, 1)
    return out


def with_layout_changed(src: str) -> str:
    """Blank lines added, and the first list in brackets broken over two lines."""
    out = src.replace("\n\n\n", "\n\n\n\n")
    depth = 0
    for tok in _tokens(out):
        if tok.type == tokenize.OP:
            depth += (tok.string in "([{") - (tok.string in ")]}")
            if depth and tok.string == ",":
                return _replace(out, tok, ",\n        ")
    return out


@pytest.mark.parametrize("module", HASHED)
@pytest.mark.parametrize("edit", [with_comments, with_docstrings_rewritten, with_layout_changed])
def test_comment_docstring_and_layout_edits_keep_the_tokens(module, edit):
    src = source(module)
    edited = edit(src)
    assert edited != src
    ast.parse(edited)
    assert code_tokens(edited) == code_tokens(src)


OTHER_OPERATOR = {"+": "-", "-": "+", "//": "%", "%": "//", "==": "!=", "!=": "=="}


@pytest.mark.parametrize("module", HASHED)
def test_code_edits_change_the_tokens(module):
    """A constant and an operator changed (each edit still parses)."""
    src = source(module)
    tokens = _tokens(src)
    number = next(t for t in tokens if t.type == tokenize.NUMBER)
    operator = next(t for t in tokens if t.type == tokenize.OP and t.string in OTHER_OPERATOR)
    for tok, new in ((number, "3" if number.string == "2" else "2"),
                     (operator, OTHER_OPERATOR[operator.string])):
        edited = _replace(src, tok, new)
        ast.parse(edited)
        assert code_tokens(edited) != code_tokens(src)


def test_strings_that_are_code_count_and_docstrings_do_not():
    base = 'def f(x):\n    """Doc."""\n    if x:\n        "not a docstring"\n    return "a"\n'
    assert code_tokens(base.replace('"a"', '"b"')) != code_tokens(base)
    assert code_tokens(base.replace('"not a', '"no longer a')) != code_tokens(base)
    assert code_tokens(base.replace('"""Doc."""', '"Other."')) == code_tokens(base)
    assert code_tokens(base.replace('    """Doc."""\n', "")) == code_tokens(base)
    assert code_tokens(base.replace("    ", "  ")) == code_tokens(base)  # indentation width
    assert code_tokens(base.replace("    if x:\n", "    while x:\n")) != code_tokens(base)
    # ast gives a docstring's end in UTF-8 bytes, tokenize in characters: the ";" is not in it
    assert "OP ;" in code_tokens('def f(): "d\u00e9j\u00e0"; return 1\n')


def test_an_f_string_is_one_token():
    """As Python 3.11 tokenizes it; 3.12 splits f-strings, and the hash must not follow."""
    src = 'x = f"a{{b}}{y!r:>{w}}" + f"{f\'{z}\'}"\n'
    assert code_tokens(src) == ["NAME x", "OP =", 'STRING f"a{{b}}{y!r:>{w}}"', "OP +",
                                "STRING f\"{f'{z}'}\"", "NEWLINE"]


@pytest.fixture
def edited_sources(monkeypatch):
    """Serve edited sources to the kernel hash: `edit(module, fn)` applies fn to its source."""
    real = inspect.getsource
    edits = {}

    def getsource(obj):
        src = real(obj)
        name = getattr(obj, "__name__", None)
        return edits[name](src) if name in edits else src

    def edit(module, fn):
        edits[module] = fn
        spec_module._module_hash.cache_clear()

    monkeypatch.setattr(inspect, "getsource", getsource)
    spec_module._module_hash.cache_clear()
    yield edit
    spec_module._module_hash.cache_clear()


def hashes() -> dict[str, str]:
    return {name: spec.kernel_hash() for name, spec in SPECS.items()}


def test_comment_and_docstring_edits_keep_every_kernel_hash(edited_sources):
    before = hashes()
    for module in HASHED:
        edited_sources(module, lambda src: with_docstrings_rewritten(with_comments(src)))
    assert hashes() == before


def test_a_code_edit_in_a_shared_helper_changes_the_hashes_of_its_users(edited_sources):
    before = hashes()
    edited_sources("tileops.ops.online_softmax", lambda src: src.replace("FAST_MATH = True",
                                                                         "FAST_MATH = False"))
    after = hashes()
    changed = {name for name in SPECS if after[name] != before[name]}
    assert changed == {"attention", "attention_backward", "attention_varlen",
                       "attention_varlen_backward", "attention_paged", "mla_decode"}


def test_a_host_side_edit_keeps_every_kernel_hash(edited_sources):
    before = hashes()
    edited_sources("tileops.ops.host", lambda src: src.replace("99 * 1024", "98 * 1024"))
    edited_sources("tileops.ops.mxfp4.format", lambda src: src + "\nEXTRA = 1\n")
    assert hashes() == before


def test_kernel_hash_follows_the_helpers_a_kernel_module_imports():
    assert _tileops_imports("tileops.ops.attention.kernels") == {
        "tileops.ops.common", "tileops.ops.online_softmax"}
    assert _tileops_imports("tileops.ops.mxfp4.kernels") == {
        "tileops.ops.common", "tileops.ops.cpu_tiles", "tileops.ops.gpu_tiles",
        "tileops.ops.mxfp4.constants"}


def test_no_kernel_module_reaches_host_side_code():
    """Host code imported by a kernel module would stale tuning records on host-only edits."""
    assert not set(HASHED) & HOST_ONLY
    assert not [m for m in HASHED if m.endswith(".spec")]
