"""The shipped configs: each `NAME.py` binds a `jaxserve.config.Config` to `CONFIG`.
`jaxserve.config.load_config("NAME")` finds them by name; a path works too.

May import: jaxserve.config only (a config says what, not how)."""
