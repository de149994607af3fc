//! Subcommands of the `merg` binary that are larger than a screen (binary-only modules; the
//! library under src/ holds the logic they call).

pub mod eval;
pub mod report;
pub mod respond;
