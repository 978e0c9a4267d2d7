//! Rendering a RunResult as one self-contained HTML fragment.
