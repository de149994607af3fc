//! JSON-schema constraints (in progress).
