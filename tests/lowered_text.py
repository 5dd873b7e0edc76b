"""Counting ops in a lowered (StableHLO text) program the way it runs: a function that a
nested `jax.jit` made (the model's decoder layer, jaxserve.model.transformer) appears once
in the text however often it is called, so an op's count in the whole text is not the
number of times the program runs it. `count_executed` counts `@main`'s ops with every
`call @f(...)` replaced by `f`'s own count, recursively (XLA inlines those calls before it
optimises)."""

import functools
import re

_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$-]+)\(", re.M)
# `call @f(` and `func.call @f(`, not `custom_call @target(`
_CALL = re.compile(r"(?<![\w])call @([\w.$-]+)\(")


def functions(text: str) -> dict[str, str]:
    """{name: the text from its `func.func` line to the next function's}."""
    heads = list(_FUNC.finditer(text))
    if not heads:
        raise ValueError("no func.func in the text: not a lowered module")
    return {m.group(1): text[m.start():heads[i + 1].start() if i + 1 < len(heads) else None]
            for i, m in enumerate(heads)}


def count_executed(text: str, needle: str, entry: str = "main") -> int:
    """How many times `needle` occurs in `entry` with each call expanded into the callee's
    body (a callee's `func.func` line itself is not counted). Raises ValueError for a call
    to a function the text does not define (JAX's lowered modules do not recurse)."""
    funcs = functions(text)
    if entry not in funcs:
        raise ValueError(f"entry {entry!r} not among the module's functions {sorted(funcs)}")

    @functools.cache
    def count(name: str) -> int:
        if name not in funcs:
            raise ValueError(f"call to @{name}, which the module does not define")
        body = funcs[name].partition("\n")[2]
        return body.count(needle) + sum(count(callee) for callee in _CALL.findall(body))

    return count(entry)
