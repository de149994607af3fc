//! Errors in the words the user typed. The library names a bad value by its own setting name
//! (`merg::InvalidSetting`: `top_p`, `max_context`); here that name becomes the flag of the
//! command that ran (`--top-p`) and the value is shown exactly as it was typed (`1.50`, not a
//! re-formatted `1.5`), or marked as the flag's default when the user gave none. Flags whose
//! wording differs from the library's name carry the library's name as their clap id.

use std::sync::OnceLock;

use clap::parser::ValueSource;
use clap::{ArgMatches, Command};

use merg::InvalidSetting;

/// The parsed command line, kept for the error path.
static TYPED: OnceLock<(Command, ArgMatches)> = OnceLock::new();

/// Keeps `merg`'s command and what it parsed; the error path reads them.
pub fn remember(cmd: Command, matches: ArgMatches) {
    let _ = TYPED.set((cmd, matches));
}

/// `e` with its bad setting (if any) restated as the flag and the value the user typed. Errors
/// about a value from elsewhere (a model's config) keep their own wording.
pub fn in_user_words(e: anyhow::Error) -> anyhow::Error {
    let Some(bad) = e.chain().find_map(|c| c.downcast_ref::<InvalidSetting>()).filter(|s| s.origin.is_none()) else {
        return e;
    };
    let Some((cmd, matches)) = TYPED.get() else { return e };
    match restate(cmd, matches, bad) {
        Some(msg) => anyhow::anyhow!(msg),
        None => e,
    }
}

/// "--top-p 1.50: must be in (0, 1]" for the subcommand that ran, if it has that flag.
fn restate(cmd: &Command, matches: &ArgMatches, bad: &InvalidSetting) -> Option<String> {
    let (name, sub) = matches.subcommand()?;
    let arg = cmd.find_subcommand(name)?.get_arguments().find(|a| a.get_id() == bad.name)?;
    let flag = format!("--{}", arg.get_long()?);
    let typed: Vec<String> = sub.get_raw(bad.name)?.map(|v| v.to_string_lossy().into_owned()).collect();
    // Of a list flag (`--quant f32 q9`), the one entry at fault.
    let typed = match typed.iter().find(|t| t.trim() == bad.value) {
        Some(one) => one.clone(),
        None => typed.join(" "),
    };
    Some(match sub.value_source(bad.name) {
        Some(ValueSource::CommandLine) => format!("{flag} {typed}: must be {}", bad.rule),
        _ => format!("{flag} is {typed} by default, which must be {}: give it a value", bad.rule),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, Command};

    fn parsed(args: &[&str]) -> (Command, ArgMatches) {
        let sub = Command::new("generate")
            .allow_negative_numbers(true)
            .arg(Arg::new("top_p").long("top-p").default_value("1.0"))
            .arg(Arg::new("max_new_tokens").long("new-tokens").default_value("0"));
        let cmd = Command::new("merg").subcommand(sub);
        let m = cmd.clone().try_get_matches_from(args).unwrap();
        (cmd, m)
    }

    #[test]
    fn a_typed_value_is_named_by_its_flag_as_typed() {
        let (cmd, m) = parsed(&["merg", "generate", "--top-p", "-1.50"]);
        let bad = InvalidSetting::new("top_p", -1.5, "in (0, 1]");
        assert_eq!(restate(&cmd, &m, &bad).unwrap(), "--top-p -1.50: must be in (0, 1]");
    }

    #[test]
    fn a_default_is_named_as_the_default_and_unknown_names_are_left_alone() {
        let (cmd, m) = parsed(&["merg", "generate"]);
        let bad = InvalidSetting::new("max_new_tokens", 0, "at least 1");
        assert_eq!(restate(&cmd, &m, &bad).unwrap(), "--new-tokens is 0 by default, which must be at least 1: give it a value");
        assert!(restate(&cmd, &m, &InvalidSetting::new("t_max", 9, "0 to 5")).is_none());
    }
}
