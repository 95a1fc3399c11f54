//! loom models live in `tests/`; they compile only with `--cfg spillway_loom`.
