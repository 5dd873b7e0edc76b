"""One writer per Sequence field: every assignment to, or in-place change of, a Sequence's
field in the package happens in the module its docstring names (jaxserve.engine.sequence).
Checked on the source (ast): `x.field = ...`, `x.field += ...`, `x.field[...] = ...`,
`del x.field[...]` and `x.field.append / extend / pop / ...` for any object named like a
sequence (seq, s, victim, r)."""

import ast
import dataclasses
from pathlib import Path

import pytest

from jaxserve.engine.sequence import Sequence

PACKAGE = Path(__file__).resolve().parent.parent / "jaxserve"
SEQ_NAMES = {"seq", "s", "victim", "r"}
MUTATORS = {"append", "extend", "pop", "insert", "remove", "clear", "__setitem__", "sort",
            "reverse", "__delitem__"}

# field -> the module that writes it (the Sequence docstring's grouping); fields set only
# when the Sequence is made (by the input processor or a test) have no writer here.
WRITER = {
    "output_ids": "engine/scheduler.py", "status": "engine/scheduler.py",
    "num_computed": "engine/scheduler.py", "admitted": "engine/scheduler.py",
    "num_preemptions": "engine/scheduler.py", "finish_reason": "engine/scheduler.py",
    "block_table": "engine/kv_cache_manager.py", "page_hashes": "engine/kv_cache_manager.py",
    "num_cached_pages": "engine/kv_cache_manager.py",
    "text": "engine/output_processor.py", "logprobs": "engine/output_processor.py",
    "prompt_logprobs": "engine/output_processor.py",
    "pooled_sum": "engine/output_processor.py", "embedding": "engine/output_processor.py",
    "lora_slot": "engine/lora_manager.py",
}
SET_ONCE = {"request_id", "prompt_ids", "params", "seed", "controls", "matcher",
            "detokenizer", "stop_checker", "lora_name", "cache_salt", "pooling"}


def _seq_field(node) -> str | None:
    """The Sequence field `node` (an expression) names, if it is `<seq name>.<field>`."""
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in SEQ_NAMES and node.attr in WRITER.keys() | SET_ONCE):
        return node.attr
    return None


def _target_fields(target):
    """Sequence fields an assignment target writes: `x.f`, `x.f[...]`, `x.f[...][...]`, or
    any of a tuple's (never a name read inside an index)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            yield from _target_fields(elt)
        return
    while isinstance(target, ast.Subscript):
        target = target.value
    field = _seq_field(target)
    if field:
        yield field


def _writes(tree):
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            for field in _target_fields(t):
                yield node.lineno, field
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS):
            field = _seq_field(node.func.value)
            if field:
                yield node.lineno, field


def test_the_table_covers_every_field():
    assert {f.name for f in dataclasses.fields(Sequence)} == WRITER.keys() | SET_ONCE


def test_each_field_has_its_one_writer():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "engine/sequence.py":
            continue  # the dataclass itself (__post_init__ fills the logprob lists)
        for line, field in _writes(ast.parse(path.read_text())):
            if WRITER.get(field) != rel:
                wrong.append(f"jaxserve/{rel}:{line} writes Sequence.{field} "
                             f"(its writer: {WRITER.get(field, 'none: set once')})")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_writes(tmp_path, monkeypatch):
    """The checker itself: the engine appending to output_ids is reported."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "engine.py").write_text("seq.output_ids.append(1)\ns.text = ''\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    with pytest.raises(AssertionError, match=r"engine.py:1 writes Sequence.output_ids"):
        test_each_field_has_its_one_writer()
