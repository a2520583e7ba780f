//! Command-line flags of the benches (`--name VALUE`).

/// The value after flag `name` in `args`, if the flag is given.
pub fn flag_value(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}
