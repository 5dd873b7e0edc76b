"""The `jaxserve` command: `jaxserve serve|batch|bench|convert|plan-memory` (`main`), and
its flags (`args`).

May import: anything in jaxserve; nothing in jaxserve imports it.
"""
