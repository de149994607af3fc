//! Block manager (in progress).
