//! A setting whose value breaks its rule, named by the library's name for it (`top_p`,
//! `max_context`). The library never knows how the value reached it: the command line maps the
//! name back to the flag the user typed and prints the value as typed, the server to the
//! request field. Keeping the name and the rule apart from the message is what lets them.

use std::fmt::Display;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{name} must be {rule}, got {value}{}", origin.as_ref().map(|o| format!(" (from {o})")).unwrap_or_default())]
pub struct InvalidSetting {
    /// The library's name of the setting (a field of a config struct).
    pub name: &'static str,
    /// The value as the library saw it, in display form.
    pub value: String,
    /// What the value must be: "at least 1", "in (0, 1]".
    pub rule: String,
    /// Where the value came from when not from the caller's own setting (a model's
    /// config.json field, a GGUF key): a front end must not blame its own flag for it.
    pub origin: Option<String>,
}

impl InvalidSetting {
    pub fn new(name: &'static str, value: impl Display, rule: impl Into<String>) -> Self {
        InvalidSetting { name, value: value.to_string(), rule: rule.into(), origin: None }
    }

    /// The value came from somewhere else than the setting `name` itself.
    pub fn from_origin(mut self, origin: impl Into<String>) -> Self {
        self.origin = Some(origin.into());
        self
    }
}

/// `Err` naming `name` unless `ok`.
pub fn check(ok: bool, name: &'static str, value: impl Display, rule: &str) -> Result<(), InvalidSetting> {
    if ok {
        Ok(())
    } else {
        Err(InvalidSetting::new(name, value, rule))
    }
}

/// A count that must be at least one (a window, a budget, a batch).
pub fn at_least_one(name: &'static str, value: usize) -> Result<(), InvalidSetting> {
    check(value >= 1, name, value, "at least 1")
}

/// A count of at most `max` (refinement rounds, exemplars).
pub fn at_most(name: &'static str, value: usize, max: usize) -> Result<(), InvalidSetting> {
    check(value <= max, name, value, &format!("0 to {max}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_names_the_setting_the_rule_and_the_origin() {
        assert_eq!(check(false, "top_p", 1.5, "in (0, 1]").unwrap_err().to_string(), "top_p must be in (0, 1], got 1.5");
        let e = InvalidSetting::new("max_context", 0, "at least 1").from_origin("config.json max_position_embeddings");
        assert_eq!(e.to_string(), "max_context must be at least 1, got 0 (from config.json max_position_embeddings)");
        assert!(at_least_one("block_size", 1).is_ok() && at_most("t_max", 6, 5).is_err());
    }
}
